// sample_row: a token drawn from row c0 of logits [R, V] (blockops/sample.py; the rule is
// megaegg/sampling.py's, step for step): greedy at temperature <= 0; else integer token weights
// w = floor(exp(z - max z) * 2^32) with z = l / T, the top-k and top-p thresholds found by radix
// selection over the scores' ordered bits (counts for top-k, integer weight for top-p: exact,
// the same in any order), and the draw from a hash of (seed, counter). One block a row; every pass
// re-reads the row from L2 (written in this launch: L1-bypassing loads).
#pragma once
#include "common.cuh"

namespace sample_impl {

__device__ __forceinline__ unsigned order_key(float f) {  // monotone: a < b <=> key(a) < key(b)
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ unsigned long long weight(float z, float zmax) {
    return (unsigned long long)((double)expf(z - zmax) * 4294967296.0);  // floor: non-negative
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
__device__ __noinline__ void sample_row(char* smem, const T* logits, long long l_s0, long long l_s1, long long V,
                                        const float* temperature, long long t_s0, const int* top_k, long long k_s0,
                                        const float* top_p, long long p_s0, const int* seed, long long s_s0,
                                        const int* counter, long long n_s0, int* out, long long out_s0, long long c0) {
    using namespace sample_impl;
    char* sm = shared_ptr(smem);
    unsigned long long* hist = reinterpret_cast<unsigned long long*>(sm);          // 256
    unsigned long long* red = hist + 256;                                          // MEGA_WARPS
    unsigned* words = reinterpret_cast<unsigned*>(red + MEGA_WARPS);               // 4
    float* fred = reinterpret_cast<float*>(words + 4);                             // 2 * MEGA_WARPS
    const T* row = logits + c0 * l_s0;
    const float temp = temperature[c0 * t_s0], p = top_p[c0 * p_s0];
    const int k = top_k[c0 * k_s0];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    // the largest logit, its first index
    float best = MEGA_NEG_INF;
    long long at = V;
    for (long long i = tid; i < V; i += MEGA_THREADS) {
        const float v = ld_f32(row + i * l_s1);
        if (v > best) best = v, at = i;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float b2 = __shfl_xor_sync(MEGA_FULL_MASK, best, o);
        const long long a2 = __shfl_xor_sync(MEGA_FULL_MASK, at, o);
        if (b2 > best || (b2 == best && a2 < at)) best = b2, at = a2;
    }
    if (lane == 0) fred[warp] = best, reinterpret_cast<long long*>(red)[warp] = at;
    mega_sync();
    best = fred[0], at = reinterpret_cast<long long*>(red)[0];
    for (int w = 1; w < MEGA_WARPS; ++w) {
        const float b2 = fred[w];
        const long long a2 = reinterpret_cast<long long*>(red)[w];
        if (b2 > best || (b2 == best && a2 < at)) best = b2, at = a2;
    }
    mega_sync();
    if (!(temp > 0.0f)) {  // greedy
        if (tid == 0) out[c0 * out_s0] = (int)at;
        return;
    }
    const float zmax = __fdiv_rn(best, temp);
    auto z = [&](long long i) { return __fdiv_rn(ld_f32(row + i * l_s1), temp); };
    auto key = [&](long long i) { return order_key(z(i)); };
    auto all = [&](long long, unsigned) { return true; };
    // top-k: the k-th largest score (ties kept)
    unsigned kth = 0;
    if (k > 0 && k < V)
        kth = radix_threshold(V, (unsigned long long)k, key, all, [](long long, unsigned) { return 1ull; }, hist, words);
    auto kept_k = [&](long long, unsigned kk) { return kk >= kth; };
    // top-p: the largest score whose kept weight at or above it reaches max(1, floor(p * kept weight))
    unsigned t = kth;
    if (p < 1.0f) {
        unsigned long long own = 0;
        for (long long i = tid; i < V; i += MEGA_THREADS) {
            const float zi = z(i);
            if (order_key(zi) >= kth) own += weight(zi, zmax);
        }
        const unsigned long long total = block_sum_u64(own, red);
        unsigned long long need = (unsigned long long)((double)p * (double)total);
        need = need < 1 ? 1 : need;
        const unsigned tp = radix_threshold(V, need, key, kept_k,
                                            [&](long long i, unsigned) { return weight(z(i), zmax); }, hist, words);
        t = tp > kth ? tp : kth;
    }
    // the draw: the first index (vocabulary order) where the running kept weight exceeds
    // floor(total * u / 2^24); thread t walks its own contiguous chunk
    const long long chunk = (V + MEGA_THREADS - 1) / MEGA_THREADS, lo = tid * chunk, hi = min_i64(V, lo + chunk);
    unsigned long long own = 0;
    for (long long i = lo; i < hi; ++i) {
        const float zi = z(i);
        if (order_key(zi) >= t) own += weight(zi, zmax);
    }
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
    const unsigned long long u = draw_bits(seed[c0 * s_s0], counter[c0 * n_s0]);
    const unsigned long long target = (total >> 24) * u + (((total & 0xFFFFFFull) * u) >> 24);
    if (excl <= target && target < excl + own) {  // exactly one thread: the weights are exact
        unsigned long long acc = excl;
        for (long long i = lo; i < hi; ++i) {
            const float zi = z(i);
            if (order_key(zi) >= t) acc += weight(zi, zmax);
            if (acc > target) {
                out[c0 * out_s0] = (int)i;
                break;
            }
        }
    }
}
