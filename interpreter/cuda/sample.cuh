// sample_row: a token drawn from row c0 of logits [R, V] (blockops/sample.py; the rule is
// megaegg/sampling.py's, step for step and bit for bit): NaN logits or a NaN temperature / top_p
// report MEGA_ERR_NAN / MEGA_ERR_NAN_SETTING and write token 0; greedy at temperature <= 0; else
// scores d = (l - max l) / T <= 0 (0 where l == max l, no overflow to +inf), integer token weights
// floor(2^32 * 2^(d log2 e)) by a fixed sequence of f32 operations (no fma: the same bits as torch's
// on the CPU), the top-k and top-p thresholds found by radix selection over the logits' ordered
// bits (counts for top-k, integer weight for top-p: exact, the same in any order), and the draw from
// a hash of (seed, counter). One block a row; every pass re-reads the row from L2 (written in this
// launch: L1-bypassing loads).
#pragma once
#include "common.cuh"

#ifndef MEGA_ERR_NAN
#define MEGA_ERR_NAN 4  // NaN logits (detail: the row); runtime.cuh / runtime.py: the same codes
#endif
#ifndef MEGA_ERR_NAN_SETTING
#define MEGA_ERR_NAN_SETTING 5  // NaN temperature (detail: 2 * row) or top_p (2 * row + 1)
#endif

namespace sample_impl {

__device__ __forceinline__ unsigned order_key(float f) {  // monotone: a < b <=> key(a) < key(b)
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The value whose order_key is k (its inverse).
__device__ __forceinline__ float key_value(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// sampling.weights of a score d <= 0: 2^32 at d == 0; else 2^(32 + x), x = d log2 e, as floor(2^32 p(f))
// >> -n with n = rint(x), f = x - n and p the degree-6 Taylor polynomial of 2^f (Horner); every step
// one rounded f32 operation (__fmul_rn / __fadd_rn are never contracted into an fma).
__device__ __forceinline__ unsigned long long weight(float d) {
    if (d == 0.0f) return 1ull << 32;
    const float x = __fmul_rn(d, 0x1.715476p+0f);
    if (!(x >= -32.0f)) return 0;  // below 1 (d = -inf included)
    const float n = rintf(x), f = __fsub_rn(x, n);
    float p = 0x1.430912p-13f;
    p = __fadd_rn(__fmul_rn(p, f), 0x1.5d87fep-10f);
    p = __fadd_rn(__fmul_rn(p, f), 0x1.3b2ab6p-7f);
    p = __fadd_rn(__fmul_rn(p, f), 0x1.c6b08ep-5f);
    p = __fadd_rn(__fmul_rn(p, f), 0x1.ebfbep-3f);
    p = __fadd_rn(__fmul_rn(p, f), 0x1.62e43p-1f);
    p = __fadd_rn(__fmul_rn(p, f), 1.0f);
    return (unsigned long long)__fmul_rn(p, 4294967296.0f) >> (int)(-n);  // (an integer: p * 2^32 >= 2^31)
}

__device__ __forceinline__ unsigned draw_bits(int seed, int counter) {  // sampling.draw_bits
    unsigned long long x = (((unsigned long long)(unsigned)seed << 32) | (unsigned)counter) + 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return (unsigned)((x ^ (x >> 31)) >> 40);
}

__device__ __forceinline__ unsigned long long block_sum_u64(unsigned long long v, unsigned long long* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(MEGA_FULL_MASK, v, o);
    mega_sync();
    if (lane == 0) red[warp] = v;
    mega_sync();
    unsigned long long t = 0;
#pragma unroll
    for (int w = 0; w < MEGA_WARPS; ++w) t += red[w];
    return t;
}

// Radix selection over the 32-bit keys of the row's elements that pass `in`, from the top digit
// down: the largest key t such that the elements with key >= t add up to at least `need`, where
// an element adds `amount(i)` (1 for top-k counts, its weight for top-p). `hist`: 256 u64.
template <class Key, class In, class Amount>
__device__ unsigned radix_threshold(long long V, unsigned long long need, Key key, In in, Amount amount,
                                    unsigned long long* hist, unsigned* shared_prefix) {
    unsigned prefix = 0, mask = 0;
    unsigned long long above = 0;  // what the elements with a larger prefix add up to
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += MEGA_THREADS) hist[b] = 0;
        mega_sync();
        for (long long i = threadIdx.x; i < V; i += MEGA_THREADS) {
            const unsigned k = key(i);
            if ((k & mask) == prefix && in(i, k)) atomicAdd(&hist[(k >> shift) & 255u], amount(i, k));
        }
        mega_sync();
        if (threadIdx.x == 0) {
            unsigned digit = 0;
            for (int b = 255; b >= 0; --b) {
                if (above + hist[b] >= need) { digit = (unsigned)b; break; }
                above += hist[b];
            }
            prefix |= digit << shift;
            shared_prefix[0] = prefix;
            reinterpret_cast<unsigned long long*>(shared_prefix)[1] = above;
        }
        mega_sync();
        prefix = shared_prefix[0];
        above = reinterpret_cast<unsigned long long*>(shared_prefix)[1];
        mask |= 255u << shift;
        mega_sync();  // (thread 0 rewrites the shared words next level)
    }
    return prefix;
}

}  // namespace sample_impl

template <class T>
__device__ __noinline__ void sample_row(char* smem, Mat<const T> logits, long long V, Vec<const float> temperature,
                                        Vec<const int> top_k, Vec<const float> top_p, Vec<const int> seed,
                                        Vec<const int> counter, Vec<int> out, long long c0) {
    in_global(logits, temperature, top_k, top_p, seed, counter, out);
    using namespace sample_impl;
    char* sm = shared_ptr(smem);
    unsigned long long* hist = reinterpret_cast<unsigned long long*>(sm);          // 256
    unsigned long long* red = hist + 256;                                          // MEGA_WARPS
    unsigned* words = reinterpret_cast<unsigned*>(red + MEGA_WARPS);               // 4
    float* fred = reinterpret_cast<float*>(words + 4);                             // 2 * MEGA_WARPS
    const T* row = logits.p + c0 * logits.s0;
    const float temp = temperature.p[c0 * temperature.s0], p = top_p.p[c0 * top_p.s0];
    const int k = top_k.p[c0 * top_k.s0];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int* const dst = out.p + c0 * out.s0;
    if (temp != temp || p != p) {  // (the same in every thread)
        if (tid == 0) {
            mega_body_error(MEGA_ERR_NAN_SETTING, 2 * c0 + (temp != temp ? 0 : 1));
            *dst = 0;  // (a token in [0, V) all the same)
        }
        return;
    }

    // the largest logit, its first index; any NaN
    float best = MEGA_NEG_INF;
    long long at = V;
    bool nan = false;
    for (long long i = tid; i < V; i += MEGA_THREADS) {
        const float v = ld_f32(row + i * logits.s1);
        nan |= v != v;
        if (v > best) best = v, at = i;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float b2 = __shfl_xor_sync(MEGA_FULL_MASK, best, o);
        const long long a2 = __shfl_xor_sync(MEGA_FULL_MASK, at, o);
        if (b2 > best || (b2 == best && a2 < at)) best = b2, at = a2;
    }
    if (lane == 0) fred[warp] = best, reinterpret_cast<long long*>(red)[warp] = at;
    if (!mega_sync_and(!nan)) {
        if (tid == 0) {
            mega_body_error(MEGA_ERR_NAN, c0);
            *dst = 0;
        }
        return;
    }
    best = fred[0], at = reinterpret_cast<long long*>(red)[0];
    for (int w = 1; w < MEGA_WARPS; ++w) {
        const float b2 = fred[w];
        const long long a2 = reinterpret_cast<long long*>(red)[w];
        if (b2 > best || (b2 == best && a2 < at)) best = b2, at = a2;
    }
    mega_sync();
    if (!(temp > 0.0f)) {  // greedy
        if (tid == 0) *dst = at < V ? (int)at : 0;  // (at == V: an all -inf row, whose first max is 0)
        return;
    }
    // scores d <= 0: 0 where l == max l (+inf logits, an all -inf row); (l - max l) / T where the difference
    // is finite, l / T - max l / T where it overflowed, else -inf; never -0 (sampling.scores)
    auto score = [&](float v) {
        if (v == best) return 0.0f;
        const float s = __fsub_rn(v, best);
        float q = MEGA_NEG_INF;
        if (fabsf(s) <= 0x1.fffffep+127f) q = __fdiv_rn(s, temp);
        else if (fabsf(v) <= 0x1.fffffep+127f && fabsf(best) <= 0x1.fffffep+127f)
            q = __fsub_rn(__fdiv_rn(v, temp), __fdiv_rn(best, temp));
        return q == 0.0f ? 0.0f : q;
    };
    // top-k and top-p select by the logits' order (the scores' too): keys of the logits, -0 as +0
    auto lkey = [](float v) { return order_key(v == 0.0f ? 0.0f : v); };
    auto key = [&](long long i) { return lkey(ld_f32(row + i * logits.s1)); };
    auto all = [&](long long, unsigned) { return true; };
    // top-k: the k-th largest logit (ties kept)
    unsigned kth = 0;
    if (k > 0 && k < V)
        kth = radix_threshold(V, (unsigned long long)k, key, all, [](long long, unsigned) { return 1ull; }, hist, words);
    auto kept_k = [&](long long, unsigned kk) { return kk >= kth; };
    // top-p: the largest logit whose kept weight at or above it reaches max(1, floor(p * kept weight))
    unsigned t = kth;
    if (p < 1.0f) {
        unsigned long long own = 0;
        for (long long i = tid; i < V; i += MEGA_THREADS) {
            const float v = ld_f32(row + i * logits.s1);
            if (lkey(v) >= kth) own += weight(score(v));
        }
        const unsigned long long total = block_sum_u64(own, red);  // >= 2^32: the maxima are kept
        const double prod = (double)p * (double)total;
        const unsigned long long need = prod >= 1.0 ? (unsigned long long)prod : 1ull;
        const unsigned tp = radix_threshold(V, need, key, kept_k,
                                            [&](long long, unsigned kk) { return weight(score(key_value(kk))); }, hist, words);
        t = tp > kth ? tp : kth;
    }
    // the draw: the first index (vocabulary order) where the running kept weight exceeds
    // floor(total * u / 2^24); thread t walks its own contiguous chunk. total <= V * 2^32 < 2^63
    auto kept_weight = [&](long long i) {
        const float v = ld_f32(row + i * logits.s1);
        return lkey(v) >= t ? weight(score(v)) : 0ull;
    };
    const long long chunk = (V + MEGA_THREADS - 1) / MEGA_THREADS, lo = tid * chunk, hi = min_i64(V, lo + chunk);
    unsigned long long own = 0;
    for (long long i = lo; i < hi; ++i) own += kept_weight(i);
    // exclusive scan of the chunks' weights over the block
    unsigned long long incl = own;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long v = __shfl_up_sync(MEGA_FULL_MASK, incl, o);
        if (lane >= o) incl += v;
    }
    if (lane == 31) red[warp] = incl;
    mega_sync();
    unsigned long long base = 0, total = 0;
    for (int w = 0; w < MEGA_WARPS; ++w) {
        if (w < warp) base += red[w];
        total += red[w];
    }
    const unsigned long long excl = base + incl - own;
    const unsigned long long u = draw_bits(seed.p[c0 * seed.s0], counter.p[c0 * counter.s0]);
    const unsigned long long target = (total >> 24) * u + (((total & 0xFFFFFFull) * u) >> 24);  // < total
    if (excl <= target && target < excl + own) {  // exactly one thread: the weights are exact, total > 0
        unsigned long long acc = excl;
        for (long long i = lo; i < hi; ++i) {
            acc += kept_weight(i);
            if (acc > target) {
                *dst = (int)i;
                break;
            }
        }
    }
}
