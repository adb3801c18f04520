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

constexpr int kBatch = 8;  // row elements each thread loads before using them (loads in flight per pass)

__device__ __forceinline__ unsigned lanemask_lt() {
    unsigned m;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
    return m;
}

// f(i, ok, v) for every thread at i = tid, tid + MEGA_THREADS, ... in increasing order (ok: i < V, v the
// logit there, 0 past V); the same number of calls in every thread, so f may use warp collectives.
// Loads are issued kBatch at a time (the row is in L2: latency-bound otherwise).
template <class T, class F>
__device__ __forceinline__ void for_row(const T* row, long long s1, long long V, F f) {
    for (long long b0 = 0; b0 < V; b0 += (long long)kBatch * MEGA_THREADS) {
        float v[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const long long i = b0 + (long long)u * MEGA_THREADS + threadIdx.x;
            v[u] = i < V ? ld_f32(row + i * s1) : 0.0f;
        }
#pragma unroll 1
        for (int u = 0; u < kBatch; ++u) {  // (one copy of f: v[0] in turn, the rest moved down)
            const long long i = b0 + (long long)u * MEGA_THREADS + threadIdx.x;
            f(i, i < V, v[0]);
#pragma unroll
            for (int e = 0; e + 1 < kBatch; ++e) v[e] = v[e + 1];
        }
    }
}

__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(MEGA_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ unsigned long long block_sum_u64(unsigned long long v, unsigned long long* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum_u64(v);
    mega_sync();
    if (lane == 0) red[warp] = v;
    mega_sync();
    unsigned long long t = 0;
#pragma unroll
    for (int w = 0; w < MEGA_WARPS; ++w) t += red[w];
    return t;
}

// The exclusive prefix of v over the block's threads (thread order) and the block's total. `red`: MEGA_WARPS.
__device__ __forceinline__ unsigned long long block_excl_u64(unsigned long long v, unsigned long long* red,
                                                             unsigned long long& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned long long incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long x = __shfl_up_sync(MEGA_FULL_MASK, incl, o);
        if (lane >= o) incl += x;
    }
    mega_sync();  // (red's last readers are done)
    if (lane == 31) red[warp] = incl;
    mega_sync();
    unsigned long long base = 0;
    total = 0;
#pragma unroll
    for (int w = 0; w < MEGA_WARPS; ++w) {
        if (w < warp) base += red[w];
        total += red[w];
    }
    return base + incl - v;
}

// Radix selection over the 32-bit keys of the row's elements that pass `in`, from the top digit
// down: the largest key t such that the elements with key >= t add up to at least `need`, where
// an element adds `amount(key)` (Unit: 1, for top-k counts; else its weight <= 2^32, for top-p).
// No atomics and no contention however the keys concentrate (a row's logits fall in a few top
// digits): each warp has its own 256 bins, and in each step the warp's lanes with the same digit
// (match.any) add up their amounts first (a popcount; or, for 2+ lanes, a whole-warp redux of the
// amounts' 16-bit halves) so that one lane updates the bin. The sums are exact integers, the same
// in any order. `hist`: MEGA_WARPS * 256 u64; `words`: 4 (16 bytes, 8-aligned).
template <bool Unit, class T, class In, class Amount>
__device__ unsigned radix_threshold(const T* row, long long s1, long long V, unsigned long long need, In in, Amount amount,
                                    unsigned long long* hist, unsigned* words) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    unsigned long long* const mine = hist + warp * 256;
    const unsigned below = lanemask_lt();
    unsigned prefix = 0, mask = 0;
    unsigned long long above = 0;  // what the elements with a larger prefix add up to
#pragma unroll 1  // (4 levels of the same code)
    for (int shift = 24; shift >= 0; shift -= 8) {
#pragma unroll 1
        for (int b = tid; b < MEGA_WARPS * 256; b += MEGA_THREADS) hist[b] = 0;
        mega_sync();
        for_row(row, s1, V, [&](long long, bool ok, float v) {
            const unsigned kk = order_key(v == 0.0f ? 0.0f : v);
            bool act = ok && (kk & mask) == prefix && in(kk);
            unsigned long long a = 0;
            if (act) a = Unit ? 1ull : amount(kk);
            act = act && a != 0;  // (weight 0 adds nothing)
            const unsigned am = __ballot_sync(MEGA_FULL_MASK, act);
            if (am == 0) return;  // (the whole warp)
            const unsigned bin = (kk >> shift) & 255u;
            unsigned peers = 0;  // the active lanes with this lane's bin
            if (act) peers = __match_any_sync(am, bin);
            if (Unit) {
                if (act && (peers & below) == 0) mine[bin] += (unsigned long long)__popc(peers);  // (distinct bins)
            } else {
                if (act && peers == 1u << lane) mine[bin] += a;  // alone in its bin
                // the bins of 2+ lanes, one at a time: their amounts (<= 2^32) summed by the whole warp in
                // 16-bit halves, whose sums fit in 32 bits; the bin's lowest lane adds the sum
                unsigned todo = __ballot_sync(MEGA_FULL_MASK, act && (peers & below) == 0 && (peers & (peers - 1)) != 0);
                while (todo) {
                    const int l = __ffs(todo) - 1;
                    todo &= todo - 1;
                    const bool in_g = (__shfl_sync(MEGA_FULL_MASK, peers, l) >> lane) & 1u;
                    const unsigned lo = __reduce_add_sync(MEGA_FULL_MASK, in_g ? (unsigned)a & 0xFFFFu : 0u);
                    const unsigned hi = __reduce_add_sync(MEGA_FULL_MASK, in_g ? (unsigned)(a >> 16) : 0u);
                    if (lane == l) mine[bin] += ((unsigned long long)hi << 16) + lo;
                }
            }
            __syncwarp();  // (this warp's next update of a bin sees this one)
        });
        mega_sync();
#pragma unroll 1
        for (int b = tid; b < 256; b += MEGA_THREADS) {  // the bins' totals over the warps, into warp 0's
            unsigned long long c = hist[b];
#pragma unroll
            for (int w = 1; w < MEGA_WARPS; ++w) c += hist[w * 256 + b];
            hist[b] = c;
        }
        mega_sync();
        if (warp == 0) {  // the digit: the largest b with above + (bins >= b) >= need; lane l has bins 8l .. 8l + 7
            unsigned long long c[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) c[j] = hist[lane * 8 + j];
#pragma unroll
            for (int j = 6; j >= 0; --j) c[j] += c[j + 1];  // c[j]: this lane's bins >= 8 lane + j
            unsigned long long hi = c[0];                   // -> the bins above this lane's
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned long long x = __shfl_down_sync(MEGA_FULL_MASK, hi, o);
                if (lane + o < 32) hi += x;
            }
            hi -= c[0];
            int j0 = -1;
            unsigned long long next = 0;  // this lane's bins above the digit (all of them when not here)
#pragma unroll
            for (int j = 7; j >= 0; --j) {
                if (j0 >= 0) continue;
                if (above + hi + c[j] >= need) j0 = j;
                else next = c[j];
            }
            const unsigned found = __ballot_sync(MEGA_FULL_MASK, j0 >= 0);
            const int winner = found ? 31 - __clz(found) : 0;
            if (lane == winner) {  // none found (not met): digit 0, everything above
                words[0] = prefix | (unsigned)(j0 >= 0 ? lane * 8 + j0 : 0) << shift;
                reinterpret_cast<unsigned long long*>(words)[1] = above + hi + next;
            }
        }
        mega_sync();
        prefix = words[0];
        above = reinterpret_cast<unsigned long long*>(words)[1];
        mask |= 255u << shift;
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
    unsigned long long* hist = reinterpret_cast<unsigned long long*>(sm);          // MEGA_WARPS * 256
    unsigned long long* red = hist + MEGA_WARPS * 256;                             // MEGA_WARPS
    unsigned* words = reinterpret_cast<unsigned*>(red + MEGA_WARPS);               // 4
    float* fred = reinterpret_cast<float*>(words + 4);                             // 2 * MEGA_WARPS
    static_assert((MEGA_WARPS * 257 + 2) * 8 + 2 * MEGA_WARPS * 4 <= MEGA_SMEM, "sample_row: shared memory");
    const T* row = logits.p + c0 * logits.s0;
    const long long s1 = logits.s1;
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
    for_row(row, s1, V, [&](long long i, bool ok, float v) {
        if (!ok) return;
        nan |= v != v;
        if (v > best) best = v, at = i;
    });
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
    // top-k: the k-th largest logit (ties kept)
    unsigned kth = 0;
    if (k > 0 && k < V)
        kth = radix_threshold<true>(row, s1, V, (unsigned long long)k, [](unsigned) { return true; },
                                    [](unsigned) { return 1ull; }, hist, words);
    // top-p: the largest logit whose kept weight at or above it reaches max(1, floor(p * kept weight))
    unsigned t = kth;
    if (p < 1.0f) {
        unsigned long long own = 0;
        for_row(row, s1, V, [&](long long, bool ok, float v) {
            if (ok && lkey(v) >= kth) own += weight(score(v));
        });
        const unsigned long long total = block_sum_u64(own, red);  // >= 2^32: the maxima are kept
        const double prod = (double)p * (double)total;
        const unsigned long long need = prod >= 1.0 ? (unsigned long long)prod : 1ull;
        const unsigned tp = radix_threshold<false>(row, s1, V, need, [&](unsigned kk) { return kk >= kth; },
                                                   [&](unsigned kk) { return weight(score(key_value(kk))); }, hist, words);
        t = tp > kth ? tp : kth;
    }
    // the draw: the first index (vocabulary order) where the running kept weight exceeds
    // target = floor(total * u / 2^24); total <= V * 2^32 < 2^63. The row in tiles of `len` consecutive
    // tokens (at most MEGA_WARPS * 256 tiles, their sums in `hist`), one warp a tile (coalesced); a scan
    // of the tiles' sums finds the tile holding the target, a scan inside it the token.
    auto kept_weight = [&](float v) { return lkey(v) >= t ? weight(score(v)) : 0ull; };
    constexpr long long kMaxTiles = MEGA_WARPS * 256;
    const long long per = (V + (long long)MEGA_THREADS * kMaxTiles - 1) / ((long long)MEGA_THREADS * kMaxTiles);
    const long long len = per * MEGA_THREADS, tiles = (V + len - 1) / len;  // thread j of a tile: per tokens
    for (long long tile = warp; tile < tiles; tile += MEGA_WARPS) {
        const long long lo = tile * len, hi = min_i64(V, lo + len);
        unsigned long long own = 0;
        for (long long j0 = lo; j0 < hi; j0 += 32 * kBatch) {
            float v[kBatch];
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                const long long i = j0 + 32 * u + lane;
                v[u] = i < hi ? ld_f32(row + i * s1) : 0.0f;
            }
#pragma unroll 1
            for (int u = 0; u < kBatch; ++u) {  // (for_row's rotation)
                if (j0 + 32 * u + lane < hi) own += kept_weight(v[0]);
#pragma unroll
                for (int e = 0; e + 1 < kBatch; ++e) v[e] = v[e + 1];
            }
        }
        own = warp_sum_u64(own);
        if (lane == 0) hist[tile] = own;
    }
    mega_sync();
    const unsigned long long u = draw_bits(seed.p[c0 * seed.s0], counter.p[c0 * counter.s0]);
    unsigned long long* const pick = reinterpret_cast<unsigned long long*>(words);  // the tile, the weight before it
    unsigned long long target;
    {  // thread j: tiles j q .. j q + q - 1
        const long long q = (tiles + MEGA_THREADS - 1) / MEGA_THREADS, lo = tid * q, hi = min_i64(tiles, lo + q);
        unsigned long long own = 0, total;
        for (long long j = lo; j < hi; ++j) own += hist[j];
        const unsigned long long excl = block_excl_u64(own, red, total);
        target = (total >> 24) * u + (((total & 0xFFFFFFull) * u) >> 24);  // < total
        if (excl <= target && target < excl + own) {  // exactly one thread: the weights are exact, total > 0
            unsigned long long acc = excl;
            for (long long j = lo; j < hi; ++j) {
                if (target < acc + hist[j]) {
                    pick[0] = (unsigned long long)j, pick[1] = acc;
                    break;
                }
                acc += hist[j];
            }
        }
        mega_sync();
    }
    const long long lo = min_i64(V, (long long)pick[0] * len + tid * per), hi = min_i64(V, lo + per);
    const unsigned long long before = pick[1];
    unsigned long long own = 0, total;
    for (long long i = lo; i < hi; ++i) own += kept_weight(ld_f32(row + i * s1));
    const unsigned long long excl = before + block_excl_u64(own, red, total);
    if (excl <= target && target < excl + own) {  // exactly one thread, as above
        unsigned long long acc = excl;
        for (long long i = lo; i < hi; ++i) {
            acc += kept_weight(ld_f32(row + i * s1));
            if (acc > target) {
                *dst = (int)i;
                break;
            }
        }
    }
}
