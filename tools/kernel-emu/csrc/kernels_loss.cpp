// The kernels of models/gpt2/src/kernels/loss.cu (src/gpt2/loss.rs): softmax
// and cross-entropy, forward and backward, the mean loss, the fused
// classifier.
#include "cuda_emu.h"

#include "loss.cu"

BRAID_EMU_EXPORT(softmax_crossentropy_forward)
BRAID_EMU_EXPORT(softmax_crossentropy_forward_bf16)
BRAID_EMU_EXPORT(crossentropy_softmax_backward)
BRAID_EMU_EXPORT(crossentropy_softmax_backward_bf16)
BRAID_EMU_EXPORT(loss_mean)
BRAID_EMU_EXPORT(fused_classifier)
BRAID_EMU_EXPORT(fused_classifier_bf16)
