// Shared device helpers of the block-op bodies (no host code).
//
// Every body runs with the block's MEGA_THREADS body threads (synchronised by mega_sync) and may use the dynamic
// shared memory `smem` (MEGA_SMEM bytes). Loads of global memory skip L1 (ld_cg, ldcg16,
// ldw16 below): activations written by another SM in the same launch are not coherent
// in L1 (docs/design.md, barrier protocol 1), and weights stream once, so L1 cannot help.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#if !defined(MEGA_THREADS) || !defined(MEGA_SMEM)
#error "MEGA_THREADS and MEGA_SMEM come from the compiler (interpreter/render.py: DEFINES)"
#endif
static_assert(MEGA_THREADS % 32 == 0 && MEGA_THREADS <= 1024, "MEGA_THREADS: whole warps, at most 1024");

#define MEGA_WARPS (MEGA_THREADS / 32)
#ifndef MEGA_ERR_LAYOUT
#define MEGA_ERR_LAYOUT 3  // a body met operand strides it does not take (runtime.py names the op)
#endif

// The barrier of the threads that run bodies: named barrier 1 over MEGA_THREADS threads (every
// thread of the block; a named barrier leaves barrier 0 to __syncthreads in the interpreter loop).
__device__ __forceinline__ void mega_sync() { asm volatile("bar.sync 1, %0;" ::"n"(MEGA_THREADS) : "memory"); }
// mega_sync that also returns whether `p` holds in every body thread.
__device__ __forceinline__ bool mega_sync_and(bool p) {
    unsigned r;
    asm volatile("{ .reg .pred a, b; setp.ne.u32 a, %1, 0; bar.red.and.pred b, 1, %2, a; selp.u32 %0, 1, 0, b; }"
                 : "=r"(r) : "r"((unsigned)p), "n"(MEGA_THREADS) : "memory");
    return r != 0;
}
#define MEGA_FULL_MASK 0xffffffffu
#define MEGA_NEG_INF __int_as_float(0xff800000)

// A traced kernel's record an instance (interpreter/trace.py: Trace.records): its entry, SM and instance;
// claimed, waits passed, done on the global clock (globaltimer: one clock for every SM, in 256 ns steps on an
// H200); then the SM's cycle counter (clock64, for the stages within an instance) at the claim issued, claimed,
// thread 0's first look at a counter, waits passed, the body's last mark (MEGA_TRACE_MARK: a matvec's x
// staged, a split's part done before its arrival), its signals issued, done (0: not reached or not taken).
#define MEGA_TRACE_WORDS 11
#ifdef MEGA_TRACE
#define MEGA_TRACE_WAITED() (t_waited = mega_globaltimer(), c_waited = clock64())
#define MEGA_TRACE_WAITS_PASSED() (t_waited = mega_t_waited, c_waited = mega_c_waited)  // when mega_wait_all passed
#define MEGA_TRACE_SIGNAL() (c_signal = clock64())
#define MEGA_TRACE_POLL() (threadIdx.x == 0 && !mega_c_poll ? (void)(mega_c_poll = clock64()) : (void)0)
#define MEGA_TRACE_MARK() (threadIdx.x == 0 ? (void)(mega_c_mark = clock64()) : (void)0)
// (the stamps within an instance that thread 0 writes and records)
__shared__ unsigned long long mega_t_waited;
__shared__ long long mega_c_waited, mega_c_poll, mega_c_mark;  // (clock64)
#else
#define MEGA_TRACE_WAITED() ((void)0)
#define MEGA_TRACE_WAITS_PASSED() ((void)0)
#define MEGA_TRACE_SIGNAL() ((void)0)
#define MEGA_TRACE_POLL() ((void)0)
#define MEGA_TRACE_MARK() ((void)0)
#endif

// An instance's barrier waits. The interpreter passes them to mega_wait_all, or hands them
// to a body that waits itself (BlockKind.waits_in_body) after issuing the loads that need
// no input, so those loads overlap the hand-off.
#ifndef MEGA_PEERS
#define MEGA_PEERS 0
#endif
#ifndef MEGA_MAX_WAITS
#define MEGA_MAX_WAITS 8  // (the interpreter defines it: the most waits of one queue entry)
#endif
struct MegaWaits {
    const unsigned* ctr[MEGA_MAX_WAITS];
    unsigned expected[MEGA_MAX_WAITS];
    int n;  // 0: nothing to wait for
#if MEGA_PEERS
    unsigned sys;  // bit i: ctr[i] is a peer counter, written by other GPUs (read at system scope)
#endif
};
// All threads: thread i < w.n waits for ctr[i] >= expected[i], then a block barrier.
// False: the block must stop (abort or timeout, error recorded). Defined in runtime.cuh.
__device__ bool mega_wait_all(const MegaWaits& w);
// All threads: one non-blocking look at the waits (acquire); true when every one is met.
__device__ bool mega_waits_met(const MegaWaits& w);

// Compile-time helpers (no <type_traits> under NVRTC).
__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }
__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int divisor_at_most(int n, int cap) { return n % cap == 0 || cap == 1 ? cap : divisor_at_most(n, cap - 1); }
template <bool B, class A, class C> struct Cond { using type = A; };
template <class A, class C> struct Cond<false, A, C> { using type = C; };
template <class A, class B> struct SameType { static constexpr bool value = false; };
template <class A> struct SameType<A, A> { static constexpr bool value = true; };

// --- warp-level tensor-core MMA (bf16 / f16 in, f32 accumulators; PTX ISA fragment layouts) ---------
template <class T>
__device__ __forceinline__ void mma16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
    if constexpr (SameType<T, __nv_bfloat16>::value)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <class T>
__device__ __forceinline__ void mma1688(float (&d)[4], unsigned a0, unsigned a1, unsigned b0) {
    if constexpr (SameType<T, __nv_bfloat16>::value)
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(b0));
    else
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(b0));
}

// ldmatrix: 8 x 8 matrices of 16-bit elements from shared memory (lanes 8i..8i+7 give matrix i's row
// addresses, 16 bytes each); .trans transposes each matrix. x2: lanes 0-15's addresses are used.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}

// --- operand views -------------------------------------------------------------------
// A tensor operand as a body takes it: the base pointer and the per-dim strides, in elements
// (element [i, j] of a Mat is p[i * s0 + j * s1]); its extents are the body's shape arguments.
// The generated calls build them (blockops/base.py: CudaOperand.view renders `Mat<const T>{p, s0, s1}`);
// an absent operand is the empty view, `Mat<const T>{}` (nullptr, zero strides). Passed by value:
// out of line (__noinline__ bodies) a view takes the registers its pointer and strides took as
// separate parameters. (No extents and no rank template argument: the entry table's literals
// must not reach a template argument list, interpreter/render.py: _holes.)
template <class T> struct Vec {
    T* p;
    long long s0;
};
template <class T> struct Mat {
    T* p;
    long long s0, s1;
    // row i as a Vec (its elements s1 apart)
    __device__ __forceinline__ Vec<T> row(long long i) const { return {p + i * s0, s1}; }
};
template <class T> struct Ten3 {
    T* p;
    long long s0, s1, s2;
    // [i, :, :] as a Mat
    __device__ __forceinline__ Mat<T> at(long long i) const { return {p + i * s0, s1, s2}; }
};
template <class T> struct Ten4 {
    T* p;
    long long s0, s1, s2, s3;
    // [i, :, :, :] as a Ten3
    __device__ __forceinline__ Ten3<T> at(long long i) const { return {p + i * s0, s1, s2, s3}; }
};

// Views whose pointers the caller placed in global memory (a body the interpreter calls gets only
// such operands: the arena, the weights, the counter bank, the peer region; not shared memory):
// plain loads and stores through them compile to LDG / STG, not generic LD / ST. (A pointer passed
// as a separate parameter of an out-of-line body had that inferred from its callers; inside a view
// it is not, so a body says it: `in_global(x, out);` first thing. Never an optional operand's view:
// an absent one is nullptr, and assuming that global is undefined behaviour.)
template <class T> __device__ __forceinline__ T* global_ptr(T* p) {
    __builtin_assume(__isGlobal(p));
    return p;
}
template <class... V> __device__ __forceinline__ void in_global(V&... v) { ((v.p = global_ptr(v.p)), ...); }

// --- dim expressions (Dim.to_c emits min_i64 / max_i64) ----------------------------
__device__ __forceinline__ long long min_i64(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ long long max_i64(long long a, long long b) { return a > b ? a : b; }

// --- element conversions: fp32 is the compute type ---------------------------------
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(int v) { return (float)v; }

template <class T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ int from_f32<int>(float v) { return (int)v; }  // truncates, as torch's .to(int32)

// v rounded to T's precision and back: where a cpu() does `.to(dt).float()`.
template <class T> __device__ __forceinline__ float round_to(float v) { return to_f32(from_f32<T>(v)); }

// Element conversion between storage types (bit copy when equal; ints stay exact).
template <class TO, class TI> struct Convert {
    static __device__ __forceinline__ TO run(TI v) { return from_f32<TO>(to_f32(v)); }
};
template <class T> struct Convert<T, T> {
    static __device__ __forceinline__ T run(T v) { return v; }
};
template <class TO, class TI> __device__ __forceinline__ TO convert(TI v) { return Convert<TO, TI>::run(v); }

// --- Global loads that skip L1 -----------------------------------------------------
// Activations and partials: ld.global.cg (L2 only). It compiles to a strong gpu-scope load
// on sm_90; a weak L1::no_allocate load measured the same here (perf-notes #22).
__device__ __forceinline__ float ld_cg(const float* p) { return __ldcg(p); }
__device__ __forceinline__ int ld_cg(const int* p) { return __ldcg(p); }
__device__ __forceinline__ __nv_bfloat16 ld_cg(const __nv_bfloat16* p) {
    return __ushort_as_bfloat16(__ldcg(reinterpret_cast<const unsigned short*>(p)));
}
__device__ __forceinline__ __half ld_cg(const __half* p) {
    return __ushort_as_half(__ldcg(reinterpret_cast<const unsigned short*>(p)));
}
template <class T> __device__ __forceinline__ float ld_f32(const T* p) { return to_f32(ld_cg(p)); }
__device__ __forceinline__ uint4 ldcg16(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }

// A weight stream's 16-byte load: weak ld.global.L1::no_allocate. The strong loads of
// ld.global.cg streamed weights 9% slower a decode step (perf-notes #22). Weights do not
// change during a launch, so the asm is not volatile: the compiler may issue it early.
__device__ __forceinline__ uint4 ldw16(const void* p) {
    uint4 r;
    asm("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// 16-byte vectors: VecN<T> elements (8 bf16/f16, 4 f32) per 16-byte load.
template <class T> struct VecN { static constexpr int value = 16 / (int)sizeof(T); };

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0; }

// Can rows of `rows` elements of T at `p` (row stride s0, unit column stride) be read
// with 16-byte vectors? (Pointer and row stride 16-byte aligned, row length whole vectors.)
template <class T>
__device__ __forceinline__ bool vec_rows_ok(const T* p, long long s0, long long s1, long long cols) {
    const long long v = VecN<T>::value;
    return s1 == 1 && cols % v == 0 && aligned16(p) && ((s0 * (long long)sizeof(T)) & 15) == 0;
}

// Unpack a 16-byte vector of T into VecN<T> floats.
__device__ __forceinline__ void unpack16(const uint4& u, float* f, const float*) {
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void bf16x2_to_f32(unsigned w, float* f) {
    f[0] = __uint_as_float(w << 16);
    f[1] = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void unpack16(const uint4& u, float* f, const __nv_bfloat16*) {
    bf16x2_to_f32(u.x, f); bf16x2_to_f32(u.y, f + 2); bf16x2_to_f32(u.z, f + 4); bf16x2_to_f32(u.w, f + 6);
}
__device__ __forceinline__ void half2_to_f32(unsigned w, float* f) {
    __half2 h = *reinterpret_cast<const __half2*>(&w);
    float2 v = __half22float2(h);
    f[0] = v.x; f[1] = v.y;
}
__device__ __forceinline__ void unpack16(const uint4& u, float* f, const __half*) {
    half2_to_f32(u.x, f); half2_to_f32(u.y, f + 2); half2_to_f32(u.z, f + 4); half2_to_f32(u.w, f + 6);
}
template <class T> __device__ __forceinline__ void unpack16(const uint4& u, float* f) {
    unpack16(u, f, static_cast<const T*>(nullptr));
}

// Pack VecN<T> floats (rounded to nearest even) into a 16-byte vector of T.
template <class T> __device__ __forceinline__ uint4 pack16(const float* f) {
    uint4 u;
    T* t = reinterpret_cast<T*>(&u);
#pragma unroll
    for (int e = 0; e < VecN<T>::value; ++e) t[e] = from_f32<T>(f[e]);
    return u;
}

// The vector load helper: 16 bytes of T at p (16-byte aligned) as VecN<T> floats.
template <class T> __device__ __forceinline__ void load16_f32(const T* p, float* f) {
    unpack16<T>(ldcg16(p), f);
}

// VecN<T> consecutive elements (column stride s1) as floats: one 16-byte load when
// `vec`, else element by element.
template <class T>
__device__ __forceinline__ void load_vec_f32(const T* p, long long s1, bool vec, float* f) {
    if (vec) {
        load16_f32(p, f);
    } else {
#pragma unroll
        for (int e = 0; e < VecN<T>::value; ++e) f[e] = ld_f32(p + e * s1);
    }
}

// --- dynamic shared memory ------------------------------------------------------------
// Bodies may be compiled out of line (__noinline__), where the `smem` argument is a plain
// generic pointer: re-derive it from this extern array (the same dynamic shared memory)
// so that accesses compile to shared-space instructions (LDS/STS), not generic ones.
extern __shared__ __align__(16) char mega_dyn_smem[];
template <class T = char> __device__ __forceinline__ T* shared_ptr(void* p) {
    const unsigned off = (unsigned)__cvta_generic_to_shared(p) - (unsigned)__cvta_generic_to_shared(mega_dyn_smem);
    return reinterpret_cast<T*>(mega_dyn_smem + off);
}

// --- cp.async (sm_80+): 16-byte global -> shared copies that bypass L1 (.cg) --------
// src_bytes < 16 zero-fills the rest (0: no global read at all).
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* src, int src_bytes) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// --- warp and block reductions ------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(MEGA_FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(MEGA_FULL_MASK, v, o));
    return v;
}

// Sum (max) over the whole block of N values per thread; every thread gets the results.
// `red` is shared memory of >= MEGA_WARPS * N floats. Begins with a barrier, so calls
// may follow each other on the same scratch. All threads must call it.
template <int N>
__device__ __forceinline__ void block_reduce_sum_n(float (&v)[N], float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = warp_sum(v[i]);
    mega_sync();
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < N; ++i) red[i * MEGA_WARPS + warp] = v[i];
    }
    mega_sync();
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = warp_sum(lane < MEGA_WARPS ? red[i * MEGA_WARPS + lane] : 0.0f);
}

__device__ __forceinline__ float block_reduce_sum(float v, float* red) {
    float a[1] = {v};
    block_reduce_sum_n<1>(a, red);
    return a[0];
}

__device__ __forceinline__ float block_reduce_max(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    mega_sync();
    if (lane == 0) red[warp] = v;
    mega_sync();
    return warp_max(lane < MEGA_WARPS ? red[lane] : MEGA_NEG_INF);
}

// The arrival-counter protocol of a split op (docs/barriers.md): this block's arrival at `counter`, one of
// `of` instances that each wrote a part (attn_partial_merge, ragged_partial_merge, matvec_split, a split
// gemm tile). Every thread's stores come before thread 0's acq_rel add: as the protocol's signal it
// releases them, and the instance that sees of - 1 (the last to arrive) acquires every other one's.
// Returns whether this block is the last, the same in every thread; all threads must call it.
__device__ __noinline__ bool mega_last_arrival(unsigned* counter, unsigned of) {
    __shared__ int last;
    mega_sync();
    MEGA_TRACE_MARK();  // (a traced kernel: this split's part done)
    if (threadIdx.x == 0) {
        unsigned before;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
        last = before == of - 1;
    }
    mega_sync();
    return last;
}

// Start streaming all of [p, p + bytes) from HBM into L2 without waiting (sm_90 bulk prefetch; p and
// bytes 16-byte multiples, else nothing).
__device__ __forceinline__ void mega_prefetch_l2_range(const void* p, long long bytes) {
    const char* c = (const char*)p;
    if (((unsigned long long)c | (unsigned long long)bytes) & 15ull) return;
    while (bytes > 0) {
        const unsigned n = (unsigned)(bytes < (1LL << 20) ? bytes : (1LL << 20));
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(c), "r"(n) : "memory");
        c += n;
        bytes -= n;
    }
}

// The last split's combine of a tile split over K (gemm.cuh, matvec_split.cuh): the S f32 partial tiles,
// split s's at part + s * split_stride, element (row, col) at row * ld + col, summed in split order (the
// same sum whichever split arrived last). A thread takes 4 columns of a row (an item) at a time, ITEMS of
// them with every load in flight together: their S 16-byte partial loads (HALF: also those `half`
// columns on, a gated tile's second weight) and, with r, the residual's 4 values (r points at the tile's
// first element). The partials come from L2 (other SMs wrote them): the combine costs a few round trips,
// not one a load (a dependent load a value took ~100 us for 8 splits of 64 x 128, the residual's own
// round trip an item ~2x; perf-notes #88, #89). epi(row, col, sums, second, res) rounds and stores the
// item's columns below `cols`.
template <int S, bool HALF, class T, class Epi>
__device__ __forceinline__ void mega_combine_partials(const float* part, int ld, long long split_stride, int rows,
                                                      int cols, int half, const T* r, long long r_s0, long long r_s1,
                                                      Epi&& epi) {
    constexpr int ITEMS = cmax(1, 16 / (S * (HALF ? 2 : 1)));  // 16 partial loads (64 registers) a thread in flight
    const int groups = (cols + 3) / 4, items = rows * groups;
    const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int i0 = threadIdx.x; i0 < items; i0 += ITEMS * MEGA_THREADS) {
        float4 d[ITEMS][S], u[ITEMS][HALF ? S : 1];
        float res[ITEMS][4];
#pragma unroll
        for (int p = 0; p < ITEMS; ++p) {  // every load of every item first
            const int i = i0 + p * MEGA_THREADS, row = i / groups, col = (i % groups) * 4;
            const bool in = i < items;
            const float* t = part + (long long)row * ld + col;
#pragma unroll
            for (int s = 0; s < S; ++s) {
                d[p][s] = in ? __ldcg(reinterpret_cast<const float4*>(t + s * split_stride)) : z;
                if constexpr (HALF) u[p][s] = in ? __ldcg(reinterpret_cast<const float4*>(t + s * split_stride + half)) : z;
            }
#pragma unroll
            for (int j = 0; j < 4; ++j)
                res[p][j] = r != nullptr && in && col + j < cols ? ld_f32(r + row * r_s0 + (col + j) * r_s1) : 0.0f;
        }
#pragma unroll
        for (int p = 0; p < ITEMS; ++p) {
            const int i = i0 + p * MEGA_THREADS;
            if (i >= items) break;
            float y[4] = {0.0f, 0.0f, 0.0f, 0.0f}, g[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int s = 0; s < S; ++s) {
                y[0] += d[p][s].x, y[1] += d[p][s].y, y[2] += d[p][s].z, y[3] += d[p][s].w;
                if constexpr (HALF) g[0] += u[p][s].x, g[1] += u[p][s].y, g[2] += u[p][s].z, g[3] += u[p][s].w;
            }
            epi(i / groups, (i % groups) * 4, y, g, res[p]);
        }
    }
}

// Online-softmax pair (running max m, sum s of exp(x - m)): merge two partial states.
__device__ __forceinline__ void softmax_merge(float& m, float& s, float m2, float s2) {
    const float mn = fmaxf(m, m2);
    if (mn == MEGA_NEG_INF) return;  // both empty
    s = s * expf(m - mn) + s2 * expf(m2 - mn);
    m = mn;
}

// fp32 silu as torch computes it on the CPU: x / (1 + exp(-x)).
__device__ __forceinline__ float silu_f32(float v) { return v / (1.0f + expf(-v)); }
