// C entry points of models/gpt2/src/kernels/loss.cu (src/lib.rs): softmax and
// cross-entropy, forward and backward, the mean loss, the fused classifier.
#include "cuda_emu.h"

#include "loss.cu"

extern "C" int emu_softmax_crossentropy_forward(BRAID_EMU_DIMS, float* probs, float* losses,
                                                const float* logits, const unsigned* targets,
                                                int N, int V, int Vp) {
    return BRAID_EMU_LAUNCH(
        softmax_crossentropy_forward(probs, losses, logits, targets, N, V, Vp));
}

extern "C" int emu_softmax_crossentropy_forward_bf16(BRAID_EMU_DIMS, bf16_t* probs,
                                                     float* losses, const bf16_t* logits,
                                                     const unsigned* targets, int N, int V,
                                                     int Vp) {
    return BRAID_EMU_LAUNCH(
        softmax_crossentropy_forward_bf16(probs, losses, logits, targets, N, V, Vp));
}

extern "C" int emu_crossentropy_softmax_backward(BRAID_EMU_DIMS, float* dlogits,
                                                 const float* probs, const unsigned* targets,
                                                 float d, int N, int V, int Vp) {
    return BRAID_EMU_LAUNCH(
        crossentropy_softmax_backward(dlogits, probs, targets, d, N, V, Vp));
}

extern "C" int emu_crossentropy_softmax_backward_bf16(BRAID_EMU_DIMS, bf16_t* dlogits,
                                                      const bf16_t* probs,
                                                      const unsigned* targets, float d, int N,
                                                      int V, int Vp) {
    return BRAID_EMU_LAUNCH(
        crossentropy_softmax_backward_bf16(dlogits, probs, targets, d, N, V, Vp));
}

extern "C" int emu_loss_mean(BRAID_EMU_DIMS, float* out, const float* losses, int N) {
    return BRAID_EMU_LAUNCH(loss_mean(out, losses, N));
}

extern "C" int emu_fused_classifier(BRAID_EMU_DIMS, float* logits, float* losses,
                                    const unsigned* targets, float d, int write_grad, int N,
                                    int V, int Vp) {
    return BRAID_EMU_LAUNCH(fused_classifier(logits, losses, targets, d, write_grad, N, V, Vp));
}

extern "C" int emu_fused_classifier_bf16(BRAID_EMU_DIMS, bf16_t* logits, float* losses,
                                         const unsigned* targets, float d, int write_grad, int N,
                                         int V, int Vp) {
    return BRAID_EMU_LAUNCH(
        fused_classifier_bf16(logits, losses, targets, d, write_grad, N, V, Vp));
}
