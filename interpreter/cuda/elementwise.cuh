// elementwise: out = FN(a[, b]) over the output's shape (blockops/elementwise.py). Up to 4
// dims; the shape and each operand's strides come as Idx4 values (broadcast dims have
// stride 0). Instance c0 covers [c0*tile, min(c0*tile + tile, shape[axis])) along `axis`
// and everything along the other dims; a flat index over that tile (last dim fastest,
// so unit-stride last dims coalesce) decomposes into coordinates, then offsets.
// Compute type: float, or int when every input is int (torch keeps ints integral);
// copy/cast between equal types is a bit copy.
#pragma once
#include "common.cuh"

struct Idx4 {
    long long d[4];
};

// Unary functors: F32 ones compute in f32 (the input converted, the result rounded once, as torch
// computes them); the others (copy, cast, neg) in the input's compute type.
struct EwF32Unary {  // (the unary functors computed in f32 derive from it)
    static constexpr int ARITY = 1;
    static constexpr bool F32 = true;
};
struct EwCopy {
    static constexpr int ARITY = 1;
    static constexpr bool F32 = false;
    template <class C> static __device__ __forceinline__ C apply(C a) { return a; }
};
struct EwCast {
    static constexpr int ARITY = 1;
    static constexpr bool F32 = false;
    template <class C> static __device__ __forceinline__ C apply(C a) { return a; }
};
struct EwSilu : EwF32Unary {
    static __device__ __forceinline__ float apply(float a) { return silu_f32(a); }
};
struct EwSigmoid : EwF32Unary {
    static __device__ __forceinline__ float apply(float a) { return 1.0f / (1.0f + expf(-a)); }
};
struct EwGelu : EwF32Unary {  // x * Phi(x)
    static __device__ __forceinline__ float apply(float a) { return 0.5f * a * (1.0f + erff(a * 0.70710678118654752f)); }
};
struct EwGeluTanh : EwF32Unary {  // 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
    static __device__ __forceinline__ float apply(float a) {
        return 0.5f * a * (1.0f + tanhf(0.79788456080286536f * (a + 0.044715f * a * a * a)));
    }
};
struct EwTanh : EwF32Unary {
    static __device__ __forceinline__ float apply(float a) { return tanhf(a); }
};
struct EwExp : EwF32Unary {
    static __device__ __forceinline__ float apply(float a) { return expf(a); }
};
struct EwCos : EwF32Unary {
    static __device__ __forceinline__ float apply(float a) { return cosf(a); }
};
struct EwSin : EwF32Unary {
    static __device__ __forceinline__ float apply(float a) { return sinf(a); }
};
struct EwAdd {
    static constexpr int ARITY = 2;
    template <class C> static __device__ __forceinline__ C apply(C a, C b) { return a + b; }
};
struct EwMul {
    static constexpr int ARITY = 2;
    template <class C> static __device__ __forceinline__ C apply(C a, C b) { return a * b; }
};
struct EwSub {
    static constexpr int ARITY = 2;
    template <class C> static __device__ __forceinline__ C apply(C a, C b) { return a - b; }
};
struct EwDiv {  // (floating point only: ops.div)
    static constexpr int ARITY = 2;
    template <class C> static __device__ __forceinline__ C apply(C a, C b) { return a / b; }
};
struct EwNeg {
    static constexpr int ARITY = 1;
    static constexpr bool F32 = false;
    template <class C> static __device__ __forceinline__ C apply(C a) { return -a; }
};

namespace ew_impl {

// The tile of this instance: its extents (32-bit: a tile is a few thousand elements)
// and the origin along `axis`.
template <int ND>
struct Tile {
    unsigned ext[ND];
    long long t0;
    unsigned count;
    __device__ __forceinline__ Tile(const Idx4& shape, int axis, long long tile, long long c0) {
        t0 = c0 * tile;
        count = 1;
#pragma unroll
        for (int d = 0; d < ND; ++d) {
            ext[d] = (unsigned)(d == axis ? max_i64(0, min_i64(tile, shape.d[d] - t0)) : shape.d[d]);
            count *= ext[d];
        }
    }
    // offsets of flat tile index i in up to 3 operands
    __device__ __forceinline__ void offsets(unsigned i, int axis, const Idx4& s0, const Idx4& s1, const Idx4& s2,
                                            long long& o0, long long& o1, long long& o2) const {
        o0 = o1 = o2 = 0;
#pragma unroll
        for (int d = ND - 1; d >= 0; --d) {
            const unsigned q = d ? i / ext[d] : 0;
            const long long c = (long long)(d ? i - q * ext[d] : i) + (d == axis ? t0 : 0);
            i = q;
            o0 += c * s0.d[d];
            o1 += c * s1.d[d];
            o2 += c * s2.d[d];
        }
    }
};

template <class TA, class TB> struct ComputeType { using type = float; };
template <> struct ComputeType<int, int> { using type = int; };

}  // namespace ew_impl

template <class FN, int ND, class TO, class TA>
__device__ __noinline__ void elementwise(Idx4 shape, int axis, long long tile, long long c0, TO* out, Idx4 out_st,
                                            const TA* a, Idx4 a_st) {
    static_assert(FN::ARITY == 1 && ND >= 1 && ND <= 4, "elementwise: unary FN, 1 to 4 dims");
    const ew_impl::Tile<ND> t(shape, axis, tile, c0);
    constexpr int U = 4;  // loads in flight per thread
    for (unsigned base = threadIdx.x; base < t.count; base += U * MEGA_THREADS) {
        long long oo[U], oa[U], unused;
        TA va[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const unsigned i = base + u * MEGA_THREADS;
            if (i < t.count) {
                t.offsets(i, axis, out_st, a_st, a_st, oo[u], oa[u], unused);
                va[u] = ld_cg(a + oa[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (base + u * MEGA_THREADS < t.count) {
                if constexpr (FN::F32)
                    out[oo[u]] = from_f32<TO>(FN::apply(to_f32(va[u])));
                else if constexpr (SameType<FN, EwNeg>::value)  // (in the compute type: ints stay integral)
                    out[oo[u]] = convert<TO>(FN::apply(convert<typename ew_impl::ComputeType<TA, TA>::type>(va[u])));
                else
                    out[oo[u]] = convert<TO>(va[u]);  // copy / cast
            }
        }
    }
}

template <class FN, int ND, class TO, class TA, class TB>
__device__ __noinline__ void elementwise(Idx4 shape, int axis, long long tile, long long c0, TO* out, Idx4 out_st,
                                            const TA* a, Idx4 a_st, const TB* b, Idx4 b_st) {
    static_assert(FN::ARITY == 2 && ND >= 1 && ND <= 4, "elementwise: binary FN, 1 to 4 dims");
    using C = typename ew_impl::ComputeType<TA, TB>::type;
    const ew_impl::Tile<ND> t(shape, axis, tile, c0);
    constexpr int U = 4;
    for (unsigned base = threadIdx.x; base < t.count; base += U * MEGA_THREADS) {
        long long oo[U], oa[U], ob[U];
        TA va[U];
        TB vb[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const unsigned i = base + u * MEGA_THREADS;
            if (i < t.count) {
                t.offsets(i, axis, out_st, a_st, b_st, oo[u], oa[u], ob[u]);
                va[u] = ld_cg(a + oa[u]);
                vb[u] = ld_cg(b + ob[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (base + u * MEGA_THREADS < t.count)
                out[oo[u]] = convert<TO>(FN::apply(convert<C>(va[u]), convert<C>(vb[u])));
    }
}
