// all_reduce over the R GPUs of a tensor-parallel group (blockops/all_reduce.py).
//
// allreduce_send: elements [c0 * tile, +tile) of this rank's x go to row `rank` of the receive
// buffer of EVERY rank: `recv` is this rank's copy, in its peer region; rank d's copy sits at the
// same offset of d's region (peers[d]), reached peer-to-peer (the stores cross NVLink). The
// interpreter then fences at system scope and signals every rank's counter.
//
// allreduce_sum: once every rank's tile arrived (the interpreter's waits, system scope), the f32
// sum of the R rows in rank order, rounded once. The rows were written by other GPUs: read through
// L2 (ld.global.cg), never a stale L1 line.
#pragma once
#include "common.cuh"

template <class X, class T, int R>
__device__ __noinline__ void allreduce_send(Vec<const X> x, T* recv, long long n, long long tile, long long c0,
                                            char* const* peers, int rank) {
    in_global(x);
    constexpr int VEC = VecN<T>::value;
    const long long s = c0 * tile, e = min_i64(n, s + tile);
    const long long at = (const char*)recv - peers[rank];  // recv's offset in every rank's region
    const bool vec = sizeof(X) == sizeof(T) && x.s0 == 1 && aligned16(x.p + s) && aligned16(recv + rank * n + s) &&
                     (e - s) % VEC == 0;
    for (int d = 0; d < R; ++d) {
        T* dst = (T*)(peers[d] + at) + rank * n;
        if (vec) {
            for (long long i = s + threadIdx.x * VEC; i < e; i += MEGA_THREADS * VEC)
                *reinterpret_cast<uint4*>(dst + i) = ldcg16(x.p + i);
        } else {  // (an f32 sum: rounded to T as it is sent)
            for (long long i = s + threadIdx.x; i < e; i += MEGA_THREADS) dst[i] = from_f32<T>(ld_f32(x.p + i * x.s0));
        }
    }
}

// all_gather's second half: once every rank's tile arrived, rank d's tile goes to out[d, tile]
// (out: the gathered row seen as [R, n]).
template <class T, int R>
__device__ __noinline__ void allgather_copy(const T* recv, Mat<T> out, long long n, long long tile, long long c0) {
    in_global(out);
    constexpr int VEC = VecN<T>::value;
    const long long s = c0 * tile, e = min_i64(n, s + tile);
    const bool vec = out.s1 == 1 && (out.s0 * (long long)sizeof(T)) % 16 == 0 && (n * (long long)sizeof(T)) % 16 == 0 &&
                     aligned16(recv + s) && aligned16(out.p + s) && (e - s) % VEC == 0;
#pragma unroll
    for (int d = 0; d < R; ++d) {
        if (vec) {
            for (long long i = s + threadIdx.x * VEC; i < e; i += MEGA_THREADS * VEC)
                *reinterpret_cast<uint4*>(out.p + d * out.s0 + i) = ldcg16(recv + d * n + i);
        } else {
            for (long long i = s + threadIdx.x; i < e; i += MEGA_THREADS) out.p[d * out.s0 + i * out.s1] = ld_cg(recv + d * n + i);
        }
    }
}

// With a residual r (not nullptr): T(r + T(sum)), the residual add the reference rounds after the sum.
template <class T, int R>
__device__ __noinline__ void allreduce_sum(const T* recv, Vec<const T> r, Vec<T> out, long long n, long long tile,
                                           long long c0) {
    in_global(out);  // (not the optional r: an absent view is nullptr)
    constexpr int VEC = VecN<T>::value;
    const long long s = c0 * tile, e = min_i64(n, s + tile);
    if (out.s0 == 1 && (r.p == nullptr || (r.s0 == 1 && aligned16(r.p + s))) && aligned16(recv + s) && aligned16(out.p + s) &&
        (n * (long long)sizeof(T)) % 16 == 0 && (e - s) % VEC == 0) {
        for (long long i = s + threadIdx.x * VEC; i < e; i += MEGA_THREADS * VEC) {
            float acc[VEC], f[VEC];
            load16_f32(recv + i, acc);
#pragma unroll
            for (int k = 1; k < R; ++k) {
                load16_f32(recv + k * n + i, f);
#pragma unroll
                for (int j = 0; j < VEC; ++j) acc[j] += f[j];
            }
            if (r.p != nullptr) {
                load16_f32(r.p + i, f);
#pragma unroll
                for (int j = 0; j < VEC; ++j) acc[j] = to_f32(from_f32<T>(acc[j])) + f[j];
            }
            *reinterpret_cast<uint4*>(out.p + i) = pack16<T>(acc);
        }
    } else {
        for (long long i = s + threadIdx.x; i < e; i += MEGA_THREADS) {
            float acc = ld_f32(recv + i);
#pragma unroll
            for (int k = 1; k < R; ++k) acc += ld_f32(recv + k * n + i);
            if (r.p != nullptr) acc = to_f32(from_f32<T>(acc)) + ld_f32(r.p + i * r.s0);
            out.p[i * out.s0] = from_f32<T>(acc);
        }
    }
}
