//! GPT-2 model configuration: the five sizes that fix every tensor shape.
//!
//! The vocabulary is not padded in the parameters: `wte` is `(V, C)` with
//! `V = vocab_size`, so checkpoints and Hugging Face weights keep their
//! shapes. Only the rows of the model's logits (and probabilities and their
//! gradients) are padded, to [`Gpt2Config::padded_vocab`] elements: see
//! [`VOCAB_ROW_MULTIPLE`].

use thiserror::Error;

/// The model's `(B, T, V)` logits rows are `V` rounded up to a multiple of
/// this many elements (GPT-2's 50,257 to 50,304, llm.c's padded vocabulary),
/// with only the first `V` columns used. An odd row length leaves every
/// other row of a bf16 (or f32) logits matrix misaligned, which keeps
/// cuBLAS off its fastest kernels for the three classifier products, the
/// largest of the step; 128 makes each row start 256-byte aligned in bf16.
/// The padding columns are never read by a product or a sum, so results
/// do not depend on it (`tests/engine_model.rs` checks bit-identity with
/// the unpadded reference at an odd vocabulary).
pub const VOCAB_ROW_MULTIPLE: usize = 128;

/// The shape-defining hyper-parameters of a GPT-2 model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Gpt2Config {
    /// Maximum sequence length `maxT` (rows of `wpe`).
    pub max_seq_len: usize,
    /// Vocabulary size `V` (rows of `wte`, columns of the logits).
    pub vocab_size: usize,
    /// Number of transformer blocks `L`.
    pub num_layers: usize,
    /// Number of attention heads `NH`.
    pub num_heads: usize,
    /// Embedding width `C`; must be divisible by `num_heads`.
    pub channels: usize,
}

/// What is wrong with a [`Gpt2Config`], or an unknown configuration name.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfigError {
    /// A size that must be positive is zero.
    #[error("GPT-2 config: `{field}` must be nonzero")]
    Zero {
        /// The offending field's name.
        field: &'static str,
    },
    /// `channels` is not a multiple of `num_heads`.
    #[error("GPT-2 config: channels ({channels}) must be divisible by num_heads ({num_heads})")]
    HeadsDoNotDivide {
        /// `C`.
        channels: usize,
        /// `NH`.
        num_heads: usize,
    },
    /// The parameters (with their gradients and AdamW moments, 16 bytes
    /// each) could not even be counted in memory: no machine holds them.
    #[error(
        "GPT-2 config: {config} has too many parameters (more than {max} bytes of parameters, \
         gradients and AdamW moments at 16 bytes each, the most any allocation can be)"
    )]
    TooLarge {
        /// The configuration, as written by `Debug`.
        config: String,
        /// The largest size of one allocation, bytes (`isize::MAX`).
        max: usize,
    },
    /// [`Gpt2Config::from_name`] got a name it does not know.
    #[error(
        "unknown GPT-2 config name `{0}` (expected one of: gpt2, gpt2-medium, gpt2-large, \
         gpt2-xl, small, tiny)"
    )]
    UnknownName(String),
}

/// The sizes, then the name of a named configuration: `4 layers, 4 heads,
/// 128 channels, vocabulary 50257, context 256 (small)`.
impl std::fmt::Display for Gpt2Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} layers, {} heads, {} channels, vocabulary {}, context {}",
            self.num_layers, self.num_heads, self.channels, self.vocab_size, self.max_seq_len
        )?;
        match self.name() {
            Some(name) => write!(f, " ({name})"),
            None => Ok(()),
        }
    }
}

impl Gpt2Config {
    /// The name [`from_name`](Self::from_name) knows this configuration by,
    /// if it is a named one.
    pub fn name(&self) -> Option<&'static str> {
        Self::NAMES
            .into_iter()
            .find(|n| Self::from_name(n).as_ref() == Ok(self))
    }

    /// The names of the named configurations, one for each.
    pub const NAMES: [&'static str; 6] = [
        "gpt2",
        "gpt2-medium",
        "gpt2-large",
        "gpt2-xl",
        "small",
        "tiny",
    ];

    /// GPT-2 small, 124M parameters: `maxT 1024, V 50257, L 12, NH 12, C 768`.
    pub const fn gpt2_124m() -> Self {
        Self::gpt2_sized(12, 12, 768)
    }

    /// GPT-2 medium, 350M: `L 24, NH 16, C 1024`.
    pub const fn gpt2_medium() -> Self {
        Self::gpt2_sized(24, 16, 1024)
    }

    /// GPT-2 large, 774M: `L 36, NH 20, C 1280`.
    pub const fn gpt2_large() -> Self {
        Self::gpt2_sized(36, 20, 1280)
    }

    /// GPT-2 XL, 1558M: `L 48, NH 25, C 1600`.
    pub const fn gpt2_xl() -> Self {
        Self::gpt2_sized(48, 25, 1600)
    }

    const fn gpt2_sized(num_layers: usize, num_heads: usize, channels: usize) -> Self {
        Self {
            max_seq_len: 1024,
            vocab_size: 50257,
            num_layers,
            num_heads,
            channels,
        }
    }

    /// A model for CPU training demos on GPT-2 BPE tokens (so `V = 50257`):
    /// `maxT 256, L 4, NH 4, C 128`, about 7.3M parameters, 6.4M of them in `wte`.
    ///
    /// The tied classifier `(B·T, C) x (C, V)` dominates the cost (about
    /// `6·B·T·V·C` flops per step, forward and backward), so demos should use
    /// short batches such as `B 4, T 64`: about a quarter of a second for a
    /// forward and backward pass of the sequential reference model on one core.
    pub const fn small() -> Self {
        Self {
            max_seq_len: 256,
            vocab_size: 50257,
            num_layers: 4,
            num_heads: 4,
            channels: 128,
        }
    }

    /// A model for tests: `maxT 64, V 512, L 2, NH 4, C 64` (head size 16),
    /// 136,960 parameters. The PyTorch fixture is made with this config.
    pub const fn tiny() -> Self {
        Self {
            max_seq_len: 64,
            vocab_size: 512,
            num_layers: 2,
            num_heads: 4,
            channels: 64,
        }
    }

    /// Looks a configuration up by name: `gpt2` (also `gpt2-124m`, `124m`),
    /// `gpt2-medium` (`350m`), `gpt2-large` (`774m`), `gpt2-xl` (`1558m`),
    /// `small`, `tiny`. Case-insensitive.
    pub fn from_name(name: &str) -> Result<Self, ConfigError> {
        match name.to_ascii_lowercase().as_str() {
            "gpt2" | "gpt2-124m" | "124m" | "d12" => Ok(Self::gpt2_124m()),
            "gpt2-medium" | "gpt2-350m" | "350m" | "d24" => Ok(Self::gpt2_medium()),
            "gpt2-large" | "gpt2-774m" | "774m" | "d36" => Ok(Self::gpt2_large()),
            "gpt2-xl" | "gpt2-1558m" | "1558m" | "d48" => Ok(Self::gpt2_xl()),
            "small" => Ok(Self::small()),
            "tiny" => Ok(Self::tiny()),
            _ => Err(ConfigError::UnknownName(name.to_owned())),
        }
    }

    /// Checks that every size is nonzero, that `C` is divisible by `NH`, and
    /// that the parameters can be counted: their count times 16 bytes
    /// (parameters, gradients, two AdamW moments) fits one allocation
    /// (`isize::MAX` bytes). Whether they fit this machine's memory is up
    /// to the allocations (see [`crate::model::try_init_params`]).
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, value) in [
            ("max_seq_len", self.max_seq_len),
            ("vocab_size", self.vocab_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("channels", self.channels),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero { field });
            }
        }
        if self.channels % self.num_heads != 0 {
            return Err(ConfigError::HeadsDoNotDivide {
                channels: self.channels,
                num_heads: self.num_heads,
            });
        }
        let max = isize::MAX as usize;
        if self
            .checked_num_parameters()
            .and_then(|n| n.checked_mul(16))
            .is_none_or(|b| b > max)
        {
            return Err(ConfigError::TooLarge {
                config: format!("{self:?}"),
                max,
            });
        }
        Ok(())
    }

    /// [`num_parameters`](Self::num_parameters), or `None` when the count
    /// overflows `usize` (or `V` rounded up to [`VOCAB_ROW_MULTIPLE`]
    /// does).
    pub fn checked_num_parameters(&self) -> Option<usize> {
        let (v, c, t, l) = (
            self.vocab_size,
            self.channels,
            self.max_seq_len,
            self.num_layers,
        );
        v.checked_next_multiple_of(VOCAB_ROW_MULTIPLE)?;
        let layers = l.checked_mul(Self::checked_layer_parameters(c)?)?;
        v.checked_mul(c)?
            .checked_add(t.checked_mul(c)?)?
            .checked_add(layers)?
            .checked_add(c.checked_mul(2)?)
    }

    /// [`layer_parameters`](Self::layer_parameters), or `None` when it
    /// overflows `usize`.
    fn checked_layer_parameters(c: usize) -> Option<usize> {
        // ln1 (2C) + qkv (3C·C + 3C) + attproj (C·C + C) + ln2 (2C)
        // + fc (4C·C + 4C) + fcproj (C·4C + C)
        c.checked_mul(c)?
            .checked_mul(12)?
            .checked_add(c.checked_mul(13)?)
    }

    /// `Vp`: the row length of the model's logits, `V` rounded up to
    /// [`VOCAB_ROW_MULTIPLE`].
    pub const fn padded_vocab(&self) -> usize {
        self.vocab_size.next_multiple_of(VOCAB_ROW_MULTIPLE)
    }

    /// Head size `hs = C / NH`.
    pub const fn head_size(&self) -> usize {
        self.channels / self.num_heads
    }

    /// Total number of parameters (the length of the flat parameter buffer).
    ///
    /// # Panics
    ///
    /// When the count overflows `usize`; [`validate`](Self::validate)
    /// refuses such a configuration.
    pub fn num_parameters(&self) -> usize {
        self.checked_num_parameters().expect(
            "the parameter count overflows usize (Gpt2Config::validate refuses this config)",
        )
    }

    /// Parameters in one transformer block: `12·C² + 13·C`.
    ///
    /// # Panics
    ///
    /// When that overflows `usize`.
    pub fn layer_parameters(c: usize) -> usize {
        Self::checked_layer_parameters(c).expect("the block's parameter count overflows usize")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configuration_reads_as_its_sizes_and_name() {
        assert_eq!(
            Gpt2Config::small().to_string(),
            "4 layers, 4 heads, 128 channels, vocabulary 50257, context 256 (small)"
        );
        assert_eq!(Gpt2Config::from_name("124m").unwrap().name(), Some("gpt2"));
        let odd = Gpt2Config {
            num_layers: 3,
            ..Gpt2Config::tiny()
        };
        assert_eq!(odd.name(), None);
        assert_eq!(
            odd.to_string(),
            "3 layers, 4 heads, 64 channels, vocabulary 512, context 64"
        );
    }

    #[test]
    fn named_configs_are_valid_and_have_known_sizes() {
        for name in Gpt2Config::NAMES {
            Gpt2Config::from_name(name).unwrap().validate().unwrap();
        }
        // The published count for GPT-2 small without padding, counting wte once.
        assert_eq!(Gpt2Config::gpt2_124m().num_parameters(), 124_439_808);
        assert_eq!(Gpt2Config::tiny().num_parameters(), 136_960);
        assert_eq!(
            Gpt2Config::from_name("GPT2-XL").unwrap(),
            Gpt2Config::gpt2_xl()
        );
    }

    #[test]
    fn invalid_configs_are_rejected_with_the_reason() {
        let mut c = Gpt2Config::tiny();
        c.num_heads = 3;
        assert_eq!(
            c.validate(),
            Err(ConfigError::HeadsDoNotDivide {
                channels: 64,
                num_heads: 3
            })
        );
        c.num_heads = 0;
        assert_eq!(c.validate(), Err(ConfigError::Zero { field: "num_heads" }));
        let mut c = Gpt2Config::tiny();
        c.vocab_size = 0;
        assert!(c.validate().unwrap_err().to_string().contains("vocab_size"));
        // Too many parameters to count, or to hold in any allocation.
        for (field, value) in [
            ("channels", 1usize << 62),
            ("num_layers", usize::MAX / 2),
            ("vocab_size", usize::MAX),
            ("max_seq_len", 1 << 60),
        ] {
            let mut c = Gpt2Config::tiny();
            match field {
                "channels" => c.channels = value,
                "num_layers" => c.num_layers = value,
                "vocab_size" => c.vocab_size = value,
                _ => c.max_seq_len = value,
            }
            if field == "channels" {
                c.num_heads = 1;
            }
            assert!(c
                .checked_num_parameters()
                .is_none_or(|n| n > isize::MAX as usize / 16));
            let err = c.validate().unwrap_err();
            assert!(
                matches!(err, ConfigError::TooLarge { .. }),
                "{field}: {err}"
            );
            assert!(err.to_string().contains("too many parameters"), "{err}");
        }
        for name in ["gpt2", "gpt2-xl", "tiny"] {
            let c = Gpt2Config::from_name(name).unwrap();
            assert_eq!(c.checked_num_parameters(), Some(c.num_parameters()));
        }
        assert!(matches!(
            Gpt2Config::from_name("gpt3"),
            Err(ConfigError::UnknownName(n)) if n == "gpt3"
        ));
    }
}
