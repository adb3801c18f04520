// moe_glu_down: one routed expert's share of a mixture of gated MLPs (blockops/moe.py).
// Instance (slot, n_tile) routes the row from the router's logits (softmax in f32, the top_k
// largest probabilities, largest first, ties to the lower expert; divided by their sum when
// `normalize`; rounded to T, as reference.moe_routing), then runs the glu_down body on the
// chosen expert's weights with the slot's routing weight as the sum's scale. The interpreter
// has waited for the logits and x before the call (the weights' address depends on them).
#pragma once
#include "glu_down.cuh"

namespace moe_impl {

// softmax(logits[:E]) into p[0, E) and its top_k largest probabilities, largest first, ties to the lower expert,
// by one warp alone (lane l owns the experts l, l + 32, ...: no block barrier, where the block-wide version paid
// ~4 a round of the top_k; perf-notes #95, #111): pick(j, probability, expert) for the j-th (expert E: none, NaN
// logits). Returns the chosen probabilities' sum. p is the warp's own; `lane` the thread's lane.
template <class TL, class Pick>
__device__ __forceinline__ float warp_top_k(float* p, const TL* logits, long long ls, int E, int top_k, int lane,
                                            Pick&& pick) {
    float m = MEGA_NEG_INF;
    for (int i = lane; i < E; i += 32) {
        p[i] = ld_f32(logits + i * ls);
        m = fmaxf(m, p[i]);
    }
    m = warp_max(m);
    float s = 0.0f;
    for (int i = lane; i < E; i += 32) {
        p[i] = expf(p[i] - m);
        s += p[i];
    }
    s = warp_sum(s);
    for (int i = lane; i < E; i += 32) p[i] /= s;
    // The j-th largest: each lane's best untaken expert (its experts ascend, so a strict > keeps the lower
    // index of equal ones), then the warp's largest key and, among the lanes holding it, the lowest index,
    // by two redux instructions: a round of 5 dependent shuffle pairs of (value, index) was ~3 us of warp 0's
    // latency before the weights could be addressed. key: a probability's bits + 1 (non-negative floats
    // order as their bits); 0 for a NaN or a taken expert, never chosen.
    float chosen = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        unsigned best = 0;
        int bi = E;
        for (int i = lane; i < E; i += 32) {
            const unsigned key = p[i] >= 0.0f ? __float_as_uint(p[i]) + 1u : 0u;
            if (key > best) best = key, bi = i;
        }
        const unsigned top = __reduce_max_sync(MEGA_FULL_MASK, best);
        const int at = (int)__reduce_min_sync(MEGA_FULL_MASK, top > 0 && best == top ? (unsigned)bi : (unsigned)E);
        const float bv = top > 0 ? __uint_as_float(top - 1u) : MEGA_NEG_INF;
        chosen += bv;
        pick(j, bv, at);
        if (at < E && (at & 31) == lane) p[at] = -1.0f;  // taken (lane-owned: the next round's reads are its own)
    }
    return chosen;
}

// The expert and routing weight of `slot` among the top_k of softmax(logits[0, :E]), found by warp 0 (warp_top_k).
// Uses smem[0, 4 * E); every thread gets the result. NaN logits report MEGA_ERR_NAN (the op's row 0) and route to
// expert 0 with weight 0, nothing read out of range.
template <class T, class TL>
__device__ void route(char* smem, Vec<const TL> logits, int E, int top_k, bool normalize, long long slot, int& expert,
                      float& weight) {
    __shared__ int routed_expert;
    __shared__ float routed_weight;
    float* p = shared_ptr<float>(smem);
    if (threadIdx.x < 32) {
        float mine = 0.0f;
        int mine_i = E;
        const int lane = threadIdx.x;
        const float chosen = warp_top_k(p, logits.p, logits.s0, E, top_k, lane, [&](int j, float v, int e) {
            if (j == slot) mine = v, mine_i = e;
        });
        if (lane == 0) {
            const bool nan = mine_i >= E;  // (NaN logits: no probability compares; none chosen)
            if (nan) mega_body_error(MEGA_ERR_NAN, 0);
            routed_expert = nan ? 0 : (int)mine_i;
            routed_weight = nan ? 0.0f : round_to<T>(normalize ? mine / chosen : mine);
        }
    }
    mega_sync();  // (the result shared; p is read by warp 0 only, so smem is free for the body)
    expert = routed_expert;
    weight = routed_weight;
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
