// kv_store: cache[slot[i], c0, pos[i], :] = new[i, c0, :] for every row i < n (blockops/kv_store.py).
// A slot or position outside the cache reports MEGA_ERR_INDEX (detail: the value) and writes
// nothing for that row.
#pragma once
#include "common.cuh"

template <class T>
__device__ __noinline__ void kv_store(Ten3<const T> src, Vec<const int> pos, Vec<const int> slot, long long n,
                                      Ten4<T> cache, long long slots, long long max_len, long long D, long long c0) {
    in_global(src, pos, slot, cache);
    constexpr int VEC = VecN<T>::value;
    const bool vec = src.s2 == 1 && cache.s3 == 1 && D % VEC == 0 && aligned16(src.p) && aligned16(cache.p) &&
                     ((src.s0 * (long long)sizeof(T)) & 15) == 0 && ((src.s1 * (long long)sizeof(T)) & 15) == 0 &&
                     ((cache.s0 * (long long)sizeof(T)) & 15) == 0 && ((cache.s1 * (long long)sizeof(T)) & 15) == 0 &&
                     ((cache.s2 * (long long)sizeof(T)) & 15) == 0;
    const long long per_row = vec ? D / VEC : D;
    for (long long k = threadIdx.x; k < n * per_row; k += MEGA_THREADS) {
        const long long i = k / per_row, e = k - i * per_row;
        const long long p = pos.p[i * pos.s0], s = slot.p[i * slot.s0];
        if (p < 0 || p >= max_len || s < 0 || s >= slots) {
            if (e == 0) mega_body_error(MEGA_ERR_INDEX, p < 0 || p >= max_len ? p : s);
            continue;
        }
        const T* from = src.p + i * src.s0 + c0 * src.s1;
        T* to = cache.p + s * cache.s0 + c0 * cache.s1 + p * cache.s2;
        if (vec)
            *reinterpret_cast<uint4*>(to + e * VEC) = ldcg16(from + e * VEC);
        else
            to[e * cache.s3] = ld_cg(from + e * src.s2);
    }
}
