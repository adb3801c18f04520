// moe_glu_down: one routed expert's share of a mixture of gated MLPs (blockops/moe.py).
// Instance (slot, n_tile) routes the row from the router's logits (softmax in f32, the top_k
// largest probabilities, largest first, ties to the lower expert; divided by their sum when
// `normalize`; rounded to T, as reference.moe_routing), then runs the glu_down body on the
// chosen expert's weights with the slot's routing weight as the sum's scale. The interpreter
// has waited for the logits and x before the call (the weights' address depends on them).
#pragma once
#include "argmax.cuh"
#include "glu_down.cuh"

namespace moe_impl {

// The expert and routing weight of `slot` among the top_k of softmax(logits[0, :E]).
// Uses smem[0, 4 * E + 256); every thread gets the result.
template <class T, class TL>
__device__ void route(char* smem, Vec<const TL> logits, int E, int top_k, bool normalize, long long slot, int& expert,
                      float& weight) {
    float* p = shared_ptr<float>(smem);
    char* red = smem + ((4 * E + 15) & ~15);
    float m = MEGA_NEG_INF;
    for (int i = threadIdx.x; i < E; i += MEGA_THREADS) {
        p[i] = ld_f32(logits.p + i * logits.s0);
        m = fmaxf(m, p[i]);
    }
    m = block_reduce_max(m, reinterpret_cast<float*>(red));
    float s = 0.0f;
    for (int i = threadIdx.x; i < E; i += MEGA_THREADS) {
        p[i] = expf(p[i] - m);
        s += p[i];
    }
    s = block_reduce_sum(s, reinterpret_cast<float*>(red));
    for (int i = threadIdx.x; i < E; i += MEGA_THREADS) p[i] /= s;
    float chosen = 0.0f, mine = 0.0f;
    long long mine_i = 0;
    for (int j = 0; j < top_k; ++j) {  // j-th largest: a block argmax, then taken out
        float bv = MEGA_NEG_INF;
        long long bi = 0x7fffffffffffffffll;
        mega_sync();  // (the previous round's removal is visible)
        for (int i = threadIdx.x; i < E; i += MEGA_THREADS)
            if (argmax_impl::better(p[i], i, bv, bi)) bv = p[i], bi = i;
        argmax_impl::block_best(bv, bi, red);
        chosen += bv;
        if (j == slot) mine = bv, mine_i = bi;
        mega_sync();
        if (threadIdx.x == 0) p[bi] = MEGA_NEG_INF;
    }
    mega_sync();  // (smem free for the body)
    expert = (int)mine_i;
    weight = round_to<T>(normalize ? mine / chosen : mine);
}

}  // namespace moe_impl

template <class T, class TL, int K, int N, int ROWS, bool NORM>
__device__ __noinline__ void moe_glu_down(char* smem, Vec<const T> x, Vec<const T> g, float eps, Vec<const TL> logits,
                                          int E, int top_k, bool normalize, long long slot, Ten3<const T> w,
                                          Ten3<const T> w2, Ten3<const T> wd, float* acc, long long F,
                                          long long n_tile) {
    in_global(x, logits, w, w2, wd);  // (not the optional g)
    int e;
    float weight;
    moe_impl::route<T>(shared_ptr(smem), logits, E, top_k, normalize, slot, e, weight);
    MegaWaits none;
    none.n = 0;  // (waited for by the interpreter)
    glu_down<T, K, N, ROWS, NORM>(smem, x, g, eps, w.at(e), w2.at(e), wd.at(e), acc, F, n_tile, none, weight);
}
