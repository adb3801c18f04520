// kv_store: cache[slot[i], c0, pos[i], :] = new[i, c0, :] for the instance's rows i (blockops/kv_store.py),
// or in a paged cache (a pool of pages) row pos[i] % page_len of page pages[slot[i], pos[i] / page_len].
// A slot, position or page outside the cache reports MEGA_ERR_INDEX (detail: the value) and writes
// nothing for that row.
#pragma once
#include "common.cuh"
#include "kv_pages.cuh"
#include "rope.cuh"

// Instance (c0, c1): head c0 of rows [c1 * rows_per, min(c1 * rows_per + rows_per, n)).
template <class T>
__device__ __noinline__ void kv_store(Ten3<const T> src, Vec<const int> pos, Vec<const int> slot, long long n,
                                      Ten4<T> cache, KvPages pages, long long D, int rows_per, long long c0, long long c1) {
    in_global(src, pos, slot, cache);
    constexpr int VEC = VecN<T>::value;
    const bool vec = src.s2 == 1 && cache.s3 == 1 && D % VEC == 0 && aligned16(src.p) && aligned16(cache.p) &&
                     ((src.s0 * (long long)sizeof(T)) & 15) == 0 && ((src.s1 * (long long)sizeof(T)) & 15) == 0 &&
                     ((cache.s0 * (long long)sizeof(T)) & 15) == 0 && ((cache.s1 * (long long)sizeof(T)) & 15) == 0 &&
                     ((cache.s2 * (long long)sizeof(T)) & 15) == 0;
    const long long per_row = vec ? D / VEC : D, r0 = c1 * rows_per, rows = min_i64(n - r0, rows_per);
#pragma unroll 4
    for (long long k = threadIdx.x; k < rows * per_row; k += MEGA_THREADS) {
        const long long i = r0 + k / per_row, e = k % per_row;
        const long long p = pos.p[i * pos.s0], s = slot.p[i * slot.s0];
        if (p < 0 || p >= pages.rows || s < 0 || s >= pages.slots) {
            if (e == 0) mega_body_error(MEGA_ERR_INDEX, p < 0 || p >= pages.rows ? p : s);
            continue;
        }
        long long bad = 0;
        const long long at = kv_row(pages, cache.s0, cache.s1, cache.s2, s, p, c0, &bad);
        if (at < 0) {
            if (e == 0) mega_body_error(MEGA_ERR_INDEX, bad);
            continue;
        }
        const T* from = src.p + i * src.s0 + c0 * src.s1;
        T* to = cache.p + at;
        if (vec)
            *reinterpret_cast<uint4*>(to + e * VEC) = ldcg16(from + e * VEC);
        else
            to[e * cache.s3] = ld_cg(from + e * src.s2);
    }
}

// kv_store_rope: as kv_store, each row rotated first as rope_rows does (at position pos_ids[i]; NORM: after
// its RMSNorm with g; HF: rope_rotate's rounding): cache[slot[i], c0, pos[i], :] = rope(new[i, c0, :]). A warp a row; a warp's rows
// (RPW of them) and their positions, slots and position ids (and the lane's frequencies and gains) are all loaded before the first is stored,
// so they cost one round trip, not three a row (a 64-row instance took 13 us with those loads inside the
// store loop: perf-notes #89).
template <class T, int D, bool NORM, int ROWS_PER, bool HF = false>
__device__ __noinline__ void kv_store_rope(Ten3<const T> src, Vec<const int> pos, Vec<const int> slot, long long n,
                                           const float* inv_freq, Vec<const int> pos_ids, Vec<const T> g, float eps,
                                           Ten4<T> cache, KvPages pages, long long c0, long long c1) {
    in_global(src, pos, slot, pos_ids, cache);
    constexpr int RPW = cdiv(ROWS_PER, MEGA_WARPS), PL = rope_pairs<D>();
    const long long i0 = c1 * ROWS_PER + (threadIdx.x >> 5), i1 = min_i64(n, c1 * ROWS_PER + ROWS_PER);
    float x1[RPW][PL], x2[RPW][PL];
    int p[RPW], s[RPW], pid[RPW];
    const RopeLane<D> lane = rope_lane<T, D, NORM>(inv_freq, g);
#pragma unroll
    for (int j = 0; j < RPW; ++j) {
        const long long i = i0 + j * MEGA_WARPS;
        if (i < i1) {
            rope_load<T, D>(src.p + i * src.s0 + c0 * src.s1, src.s2, x1[j], x2[j]);
            p[j] = ld_cg(pos.p + i * pos.s0), s[j] = ld_cg(slot.p + i * slot.s0), pid[j] = ld_cg(pos_ids.p + i * pos_ids.s0);
        }
    }
#pragma unroll
    for (int j = 0; j < RPW; ++j) {
        const long long i = i0 + j * MEGA_WARPS;
        if (i >= i1) continue;
        if (p[j] < 0 || p[j] >= pages.rows || s[j] < 0 || s[j] >= pages.slots) {
            if ((threadIdx.x & 31) == 0) mega_body_error(MEGA_ERR_INDEX, p[j] < 0 || p[j] >= pages.rows ? p[j] : s[j]);
            continue;
        }
        long long bad = 0;
        const long long at = kv_row(pages, cache.s0, cache.s1, cache.s2, s[j], p[j], c0, &bad);
        if (at < 0) {
            if ((threadIdx.x & 31) == 0) mega_body_error(MEGA_ERR_INDEX, bad);
            continue;
        }
        rope_store<T, D, NORM, true, HF>(x1[j], x2[j], (long long)pid[j], lane, eps, cache.p + at, cache.s3);
    }
}
