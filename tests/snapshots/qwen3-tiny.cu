// The megakernel: a persistent interpreter over the symbolic work queue.
//
// Every block (one per SM) loops: claim the next instance (one atomic, queue
// order), find its entry, wait for its input barriers (acquire), run the inlined
// block-op body, signal its output barriers (release). Launch counts, offsets,
// barrier indices and expected counts are expressions of the runtime dims in
// args.dims, evaluated here, so a new position needs no rebuild.
//
// Entries whose code differs only in constants (the same op in every layer) share one
// `case`; the entry table (args.table) gives each entry its case and its own constants
// E[0..] (arena offsets, pointer slots, counter bases), so the code does not grow with
// the number of layers.
//
// Counters come in two parity sets: a launch uses set `parity` and zeroes the
// other one (and its claim counter) for the next launch, so no host reset is needed.
//
// A tensor-parallel kernel (one per GPU, the same code) also has a peer region per rank, which
// every rank writes into over NVLink: the peer counters, which count across launches (a wait
// expects `seq` times its count), and the peer buffers, in two halves by the parity of `seq`
// (docs/parallel.md).
#define MEGA_MAX_WAITS 3  // the most barrier waits of one queue entry
#ifndef MEGA_REGIME
#define MEGA_REGIME -1  // a program with row regimes: the one regime whose cases this image holds (render.py)
#endif
#define MEGA_MAX_SIGNALS 1  // the most barrier sets one entry signals
#define MEGA_PEERS 0  // 1: a tensor-parallel kernel (peer counters, waits at system scope)
#include "runtime.cuh"
#include "common.cuh"
#include "argmax.cuh"
#include "attention.cuh"
#include "embedding.cuh"
#include "glu_down.cuh"
#include "kv_append.cuh"
#include "matvec.cuh"
#include "matvec_argmax.cuh"
#include "rope.cuh"

#ifndef MEGA_PEER_FENCE
// 1: a system-scope fence before the peer signals, besides their release. Off: the signalling
// thread's red.release.sys, after the block barrier, orders the block's peer stores (release is
// cumulative over bar.sync; docs/parallel.md); a TP=2 step measured 3% faster (perf-notes #54).
#define MEGA_PEER_FENCE 0
#endif

#define MEGA_ENTRIES 22
#define MEGA_COUNTERS 640
#define MEGA_LAUNCHES 1  // distinct launch counts that are runtime expressions
#define MEGA_CONSTS_AT (2 * MEGA_ENTRIES + (1 + MEGA_LAUNCHES) * (MEGA_ENTRIES + 1))  // table: the constants
// An image of one band of a row regime (interpreter/render.py: image_defines) holds the band's entries
// only, [MEGA_ENTRY0, MEGA_ENTRY0 + MEGA_IMAGE_ENTRIES) of the queue: its tables are static shared memory,
// and shared memory beyond the carve-out the image needs is L1 the bodies lose (perf-notes #88).
#ifndef MEGA_ENTRY0
#define MEGA_ENTRY0 0
#define MEGA_IMAGE_ENTRIES MEGA_ENTRIES
#endif
#define MEGA_MAX_RANKS 8  // GPUs of a tensor-parallel group (megaegg/ops.py: MAX_RANKS)

// struct MegaArgs, the by-value argument struct, and the static_asserts of its layout: interpreter/kernel_args.py
struct MegaArgs {
  char* arena;                    // scratch (lowering/queue.py: MemoryPlan.arena_bytes)
  unsigned* counters;             // 2 * MEGA_COUNTERS
  unsigned long long* control;    // see runtime.cuh
  long long parity;               // which counter set this launch uses (0, 1)
  unsigned long long* trace;      // MEGA_TRACE builds: MEGA_TRACE_WORDS words per instance
  const long long* table;         // render.py: EntryTable.words
  const char* tmaps;              // TMA tensor maps, 128 bytes each (tensor_maps.py)
  long long rank;                 // tensor parallel: this GPU's rank
  long long seq;                  // tensor parallel: this launch's number (1, 2, ...)
  char* peers[MEGA_MAX_RANKS];    // every rank's peer region (peer-to-peer addresses), by rank
  long long dims[1];              // the runtime dims, in Program.symbols order
  void* ptr[31];                  // every buffer outside the arena, by MemoryPlan.pointer_slot
};
static_assert(__builtin_offsetof(MegaArgs, arena) == 0, "MegaArgs.arena: offset differs from interpreter/kernel_args.py");
static_assert(__builtin_offsetof(MegaArgs, counters) == 8, "MegaArgs.counters: offset differs from interpreter/kernel_args.py");
static_assert(__builtin_offsetof(MegaArgs, control) == 16, "MegaArgs.control: offset differs from interpreter/kernel_args.py");
static_assert(__builtin_offsetof(MegaArgs, parity) == 24, "MegaArgs.parity: offset differs from interpreter/kernel_args.py");
static_assert(__builtin_offsetof(MegaArgs, trace) == 32, "MegaArgs.trace: offset differs from interpreter/kernel_args.py");
static_assert(__builtin_offsetof(MegaArgs, table) == 40, "MegaArgs.table: offset differs from interpreter/kernel_args.py");
static_assert(__builtin_offsetof(MegaArgs, tmaps) == 48, "MegaArgs.tmaps: offset differs from interpreter/kernel_args.py");
static_assert(__builtin_offsetof(MegaArgs, rank) == 56, "MegaArgs.rank: offset differs from interpreter/kernel_args.py");
static_assert(__builtin_offsetof(MegaArgs, seq) == 64, "MegaArgs.seq: offset differs from interpreter/kernel_args.py");
static_assert(__builtin_offsetof(MegaArgs, peers) == 72, "MegaArgs.peers: offset differs from interpreter/kernel_args.py");
static_assert(__builtin_offsetof(MegaArgs, dims) == 136, "MegaArgs.dims: offset differs from interpreter/kernel_args.py");
static_assert(__builtin_offsetof(MegaArgs, ptr) == 144, "MegaArgs.ptr: offset differs from interpreter/kernel_args.py");
static_assert(sizeof(MegaArgs) == 392, "MegaArgs: size differs from interpreter/kernel_args.py");

extern "C" __global__ void __launch_bounds__(MEGA_THREADS, 1) megakernel(const __grid_constant__ MegaArgs args) {
  extern __shared__ __align__(16) char smem[];
  __shared__ long long prefix[MEGA_IMAGE_ENTRIES + 1];  // (image-local entries: queue entry MEGA_ENTRY0 + e)
  __shared__ int entry_case[MEGA_IMAGE_ENTRIES + 1], entry_consts[MEGA_IMAGE_ENTRIES + 1];  // (+1: a queue may be empty)
  __shared__ long long claimed;
  __shared__ int claimed_entry;  // the entry of this block's last claim (claims only grow), thread 0's, handed over
  

  unsigned long long* control = args.control;
  const int parity = (int)args.parity;
  unsigned* ctr = args.counters + (parity ? MEGA_COUNTERS : 0);
  const long long D_rank = args.rank;
  (void)D_rank;
  
  const long long D_pos = args.dims[0];

  if (threadIdx.x == 0) {
    mega_control_ptr = control;
    mega_abort_block = 0;
    // (here, before the prologue's barrier: set in a branch of its own before the loop, ptxas made the loop's
    // barrier a second entry point and warp 0 reached the claim's __syncthreads split: wrong outputs, perf-notes #108)
    claimed_entry = 0;
  }
  {  // the first instance of every entry, from the table (render.py: LaunchPrefix), less the image's first
    const long long launch[MEGA_LAUNCHES] = {max_i64(0LL, (((((D_pos + 1LL)) + (64LL) - 1) / (64LL)) * 2LL))};
    const long long* base = args.table + 2 * MEGA_ENTRIES;
    auto first = [&](int e) {
      long long p = base[e];
#pragma unroll
      for (int j = 0; j < MEGA_LAUNCHES; ++j) p += base[(j + 1) * (MEGA_ENTRIES + 1) + e] * launch[j];
      return p;
    };
    const long long p0 = MEGA_ENTRY0 ? first(MEGA_ENTRY0) : 0;  // (0 in a band's launch: the bands before launch nothing)
    for (int e = threadIdx.x; e <= MEGA_IMAGE_ENTRIES; e += blockDim.x) prefix[e] = first(MEGA_ENTRY0 + e) - p0;
  }
  for (int e = threadIdx.x; e < MEGA_IMAGE_ENTRIES; e += blockDim.x) {
    entry_case[e] = (int)args.table[MEGA_ENTRY0 + e];
    entry_consts[e] = (int)args.table[MEGA_ENTRIES + MEGA_ENTRY0 + e];
  }
  {  // zero the other parity's counters and claim counter for the next launch
    unsigned* next = args.counters + (parity ? 0 : MEGA_COUNTERS);
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < MEGA_COUNTERS;
         k += (long long)gridDim.x * blockDim.x)
      next[k] = 0;
    if (blockIdx.x == 0 && threadIdx.x == 0) control[1 - parity] = 0;
  }
  __syncthreads();
  const long long total = prefix[MEGA_IMAGE_ENTRIES];
  auto find_entry = [&](long long g, int lo) {  // image entry e >= lo holds instances [prefix[e], prefix[e+1])
    int hi = MEGA_IMAGE_ENTRIES - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (prefix[mid] <= g) lo = mid; else hi = mid - 1;
    }
    return lo;
  };

  for (;;) {
    // Which instance runs, in the shared error record too (bodies report errors from any thread). It is
    // written before a barrier, so no thread still reads the previous instance's (racecheck).
#ifdef MEGA_TRACE
    long long c_issue = 0, c_signal = 0;
#endif
    if (threadIdx.x == 0) {  // claim the next instance in queue order (or stop: another block failed)
#ifdef MEGA_TRACE
      c_issue = clock64();
      mega_c_poll = mega_c_mark = 0;
#endif
      // the claim and the abort check are both in flight, not one after the other (perf-notes #62; a
      // claim past an abort runs nothing, and the next launch starts from the other parity's counter)
      const long long c = (long long)atomicAdd(&control[parity], 1ULL);
      claimed = *(volatile unsigned long long*)&control[2] ? total : c;
      if (claimed < total) {  // its entry: this block's last one or one a step or two on, mostly
        int e = claimed_entry;
        for (int k = 0; k < 4 && prefix[e + 1] <= claimed; ++k) ++e;
        if (prefix[e + 1] <= claimed) e = find_entry(claimed, e + 1);
        claimed_entry = e;
        mega_cur_entry = MEGA_ENTRY0 + e;  // (the queue's entry, for error records)
        mega_cur_instance = claimed - prefix[e];
      }
    }
    __syncwarp();  // (warp 0 whole at the barrier, whatever layout ptxas picks)
    __syncthreads();
    const long long g = claimed;
    if (g >= total) break;
    const int entry = claimed_entry;
    const long long local = g - prefix[entry];
#ifdef MEGA_TRACE
    unsigned long long t_claim = mega_globaltimer(), t_waited = 0;
    const long long c_claim = clock64();
    long long c_waited = 0;
#endif
    const long long* E = args.table + MEGA_CONSTS_AT + entry_consts[entry];  // this entry's constants
    (void)E;
    if (threadIdx.x == 32 && entry + 1 < MEGA_IMAGE_ENTRIES) {  // the next entry's constants into L1: its first
      const long long* next = args.table + MEGA_CONSTS_AT + entry_consts[entry + 1];  // instance here finds them
      asm volatile("prefetch.global.L1 [%0];" :: "l"(next));
      asm volatile("prefetch.global.L1 [%0];" :: "l"(next + 15));  // (in the table: render.py PREFETCH_PAD)
    }
    
    switch (entry_case[entry]) {
      case 0: {  // embedding: op0 (1 entries)
        unsigned rem = (unsigned)local;
        const long long c0 = rem;
        const long long D__i0 = c0; (void)D__i0;
        __nv_bfloat16* const in0 = ((__nv_bfloat16*)args.ptr[0]);
        int* const in1 = ((int*)args.ptr[1]);
        __nv_bfloat16* const out = ((__nv_bfloat16*)(args.arena + 0));
        MEGA_TRACE_WAITED();
        embedding_row<__nv_bfloat16, int>(/*table*/ Mat<const __nv_bfloat16>{in0, 256LL, 1LL}, /*ids*/ Vec<const int>{in1, 1LL}, /*V*/ (1024LL), /*D*/ 256LL, /*out*/ Mat<__nv_bfloat16>{out, 256LL, 1LL}, /*c0*/ c0);
        mega_sync();
        if (threadIdx.x == 0) {
          MEGA_TRACE_SIGNAL();
          mega_red_release(&ctr[0 + (0LL)], 1u);
        }
      } break;
      case 1: {  // matvec: op1, op2 (2 entries)
        const long long e0 = __ldg(E + 0), e1 = __ldg(E + 1), e2 = __ldg(E + 2), e3 = __ldg(E + 3), e4 = __ldg(E + 4), e5 = __ldg(E + 5), e6 = __ldg(E + 6), e7 = __ldg(E + 7), e8 = __ldg(E + 8), e9 = __ldg(E + 9);
        unsigned rem = (unsigned)local;
        const long long c1 = rem % (unsigned)(e0); rem /= (unsigned)(e1);
        const long long c0 = rem;
        const long long D__i0 = c0; (void)D__i0; const long long D__i1 = c1; (void)D__i1;
        __nv_bfloat16* const in0 = ((__nv_bfloat16*)(args.arena + 0));
        __nv_bfloat16* const in1 = ((__nv_bfloat16*)args.ptr[e2]);
        __nv_bfloat16* const in2 = ((__nv_bfloat16*)args.ptr[3]);
        __nv_bfloat16* const out = ((__nv_bfloat16*)(args.arena + e3));
        if (threadIdx.x == 0) {
          mega_prefetch_l2((const char*)args.ptr[e4] + c1 * 4096LL, (min_i64(e5 - c1 * 8, 8LL)) * 512LL);
        }
        MegaWaits wl; wl.n = 1;
        wl.ctr[0] = &ctr[0 + (0LL)]; wl.expected[0] = (unsigned)(1LL);
        matvec<__nv_bfloat16, 1, 256, 8, true, false, false, true>(/*smem*/ smem, /*x*/ Mat<const __nv_bfloat16>{(in0 + c0 * 1 * 256LL), 256LL, 1LL}, /*g*/ Vec<const __nv_bfloat16>{in2, 1LL}, /*eps*/ 1e-06f, /*w*/ Mat<const __nv_bfloat16>{in1, 256LL, 1LL}, /*w2*/ Mat<const __nv_bfloat16>{}, /*r*/ Mat<const __nv_bfloat16>{}, /*xa*/ Mat<const float>{}, /*ra*/ Mat<const float>{}, /*out*/ Mat<__nv_bfloat16>{(out + c0 * 1 * e6), e7, 1LL}, /*N*/ e8, /*n_tile*/ c1, /*mvalid*/ min_i64(1LL, (1LL) - c0 * 1), /*wl*/ wl);
        if (mega_abort_block) break;
        MEGA_TRACE_WAITS_PASSED();
        mega_sync();
        if (threadIdx.x == 0) {
          MEGA_TRACE_SIGNAL();
          mega_red_release(&ctr[e9 + ((D__i1 / 8LL))], 1u);
        }
      } break;
      case 2: {  // matvec: op3 (1 entries)
        unsigned rem = (unsigned)local;
        const long long c1 = rem % (unsigned)(16LL); rem /= (unsigned)(16LL);
        const long long c0 = rem;
        const long long D__i0 = c0; (void)D__i0; const long long D__i1 = c1; (void)D__i1;
        __nv_bfloat16* const in0 = ((__nv_bfloat16*)(args.arena + 0));
        __nv_bfloat16* const in1 = ((__nv_bfloat16*)args.ptr[5]);
        __nv_bfloat16* const in2 = ((__nv_bfloat16*)args.ptr[3]);
        __nv_bfloat16* const out = ((__nv_bfloat16*)(args.arena + 1280));
        if (threadIdx.x == 0) {
          mega_prefetch_l2((const char*)args.ptr[5] + c1 * 4096LL, (min_i64(128LL - c1 * 8, 8LL)) * 512LL);
        }
        MegaWaits wl; wl.n = 1;
        wl.ctr[0] = &ctr[0 + (0LL)]; wl.expected[0] = (unsigned)(1LL);
        matvec<__nv_bfloat16, 1, 256, 8, true, false, false, true>(/*smem*/ smem, /*x*/ Mat<const __nv_bfloat16>{(in0 + c0 * 1 * 256LL), 256LL, 1LL}, /*g*/ Vec<const __nv_bfloat16>{in2, 1LL}, /*eps*/ 1e-06f, /*w*/ Mat<const __nv_bfloat16>{in1, 256LL, 1LL}, /*w2*/ Mat<const __nv_bfloat16>{}, /*r*/ Mat<const __nv_bfloat16>{}, /*xa*/ Mat<const float>{}, /*ra*/ Mat<const float>{}, /*out*/ Mat<__nv_bfloat16>{(out + c0 * 1 * 128LL), 128LL, 1LL}, /*N*/ 128LL, /*n_tile*/ c1, /*mvalid*/ min_i64(1LL, (1LL) - c0 * 1), /*wl*/ wl);
        if (mega_abort_block) break;
        MEGA_TRACE_WAITS_PASSED();
        mega_sync();
        if (threadIdx.x == 0) {
          MEGA_TRACE_SIGNAL();
          mega_red_release(&ctr[7 + (0LL)], 1u);
        }
      } break;
      case 3: {  // rope: op4, op13 (2 entries)
        const long long e0 = __ldg(E + 0), e1 = __ldg(E + 1), e2 = __ldg(E + 2), e3 = __ldg(E + 3), e4 = __ldg(E + 4);
        unsigned rem = (unsigned)local;
        const long long c0 = rem;
        const long long D__i0 = c0; (void)D__i0;
        __nv_bfloat16* const in0 = ((__nv_bfloat16*)(args.arena + e0));
        float* const in1 = ((float*)args.ptr[6]);
        __nv_bfloat16* const in2 = ((__nv_bfloat16*)args.ptr[e1]);
        __nv_bfloat16* const out = ((__nv_bfloat16*)(args.arena + e2));
        MegaWaits wl; wl.n = 1;
        wl.ctr[0] = &ctr[e3 + (D__i0)]; wl.expected[0] = (unsigned)(8LL);
        if (!mega_wait_all(wl)) break;
        MEGA_TRACE_WAITS_PASSED();
        rope_rows<__nv_bfloat16, 64, true>(/*x*/ Mat<const __nv_bfloat16>{in0, 64LL, 1LL}, /*inv_freq*/ in1, /*pos_ids*/ Vec<const int>{}, /*pos*/ D_pos, /*group*/ 1LL, /*g*/ Vec<const __nv_bfloat16>{in2, 1LL}, /*eps*/ 1e-06f, /*out*/ Mat<__nv_bfloat16>{out, 64LL, 1LL}, /*rows*/ 4LL, /*rows_per*/ 1, /*c0*/ c0);
        mega_sync();
        if (threadIdx.x == 0) {
          MEGA_TRACE_SIGNAL();
          mega_red_release(&ctr[e4 + ((D__i0 / 2LL))], 1u);
        }
      } break;
      case 4: {  // rope: op5, op14 (2 entries)
        const long long e0 = __ldg(E + 0), e1 = __ldg(E + 1), e2 = __ldg(E + 2), e3 = __ldg(E + 3), e4 = __ldg(E + 4);
        unsigned rem = (unsigned)local;
        const long long c0 = rem;
        const long long D__i0 = c0; (void)D__i0;
        __nv_bfloat16* const in0 = ((__nv_bfloat16*)(args.arena + e0));
        float* const in1 = ((float*)args.ptr[6]);
        __nv_bfloat16* const in2 = ((__nv_bfloat16*)args.ptr[e1]);
        __nv_bfloat16* const out = (((__nv_bfloat16*)args.ptr[e2]) + (D_pos * 64LL));
        MegaWaits wl; wl.n = 1;
        wl.ctr[0] = &ctr[e3 + (D__i0)]; wl.expected[0] = (unsigned)(8LL);
        if (!mega_wait_all(wl)) break;
        MEGA_TRACE_WAITS_PASSED();
        rope_rows<__nv_bfloat16, 64, true>(/*x*/ Mat<const __nv_bfloat16>{in0, 64LL, 1LL}, /*inv_freq*/ in1, /*pos_ids*/ Vec<const int>{}, /*pos*/ D_pos, /*group*/ 1LL, /*g*/ Vec<const __nv_bfloat16>{in2, 1LL}, /*eps*/ 1e-06f, /*out*/ Mat<__nv_bfloat16>{out, 65536LL, 1LL}, /*rows*/ 2LL, /*rows_per*/ 1, /*c0*/ c0);
        mega_sync();
        if (threadIdx.x == 0) {
          MEGA_TRACE_SIGNAL();
          mega_red_release(&ctr[e4 + (D__i0)], 1u);
        }
      } break;
      case 5: {  // kv_append: op6, op15 (2 entries)
        const long long e0 = __ldg(E + 0), e1 = __ldg(E + 1), e2 = __ldg(E + 2), e3 = __ldg(E + 3);
        unsigned rem = (unsigned)local;
        const long long c0 = rem;
        const long long D__i0 = c0; (void)D__i0;
        __nv_bfloat16* const in0 = ((__nv_bfloat16*)(args.arena + e0));
        __nv_bfloat16* const out = ((__nv_bfloat16*)args.ptr[e1]);
        MegaWaits wl; wl.n = 1;
        wl.ctr[0] = &ctr[e2 + (0LL)]; wl.expected[0] = (unsigned)(16LL);
        if (!mega_wait_all(wl)) break;
        MEGA_TRACE_WAITS_PASSED();
        kv_append<__nv_bfloat16>(/*src*/ Mat<const __nv_bfloat16>{in0, 64LL, 1LL}, /*cache*/ Ten3<__nv_bfloat16>{out, 65536LL, 64LL, 1LL}, /*Hkv*/ 2LL, /*Smax*/ 1024LL, /*D*/ 64LL, /*pos*/ D_pos);
        mega_sync();
        if (threadIdx.x == 0) {
          MEGA_TRACE_SIGNAL();
          mega_red_release(&ctr[e3 + (0LL)], 1u);
        }
      } break;
      case 6: {  // attn_partial_merge: op7, op16 (2 entries)
        const long long e0 = __ldg(E + 0), e1 = __ldg(E + 1), e2 = __ldg(E + 2), e3 = __ldg(E + 3), e4 = __ldg(E + 4), e5 = __ldg(E + 5), e6 = __ldg(E + 6), e7 = __ldg(E + 7), e8 = __ldg(E + 8), e9 = __ldg(E + 9);
        unsigned rem = (unsigned)local;
        const long long c1 = rem % (unsigned)(((((D_pos + 1LL)) + (64LL) - 1) / (64LL))); rem /= (unsigned)(((((D_pos + 1LL)) + (64LL) - 1) / (64LL)));
        const long long c0 = rem;
        const long long D__i0 = c0; (void)D__i0; const long long D__i1 = c1; (void)D__i1;
        __nv_bfloat16* const in0 = ((__nv_bfloat16*)(args.arena + e0));
        __nv_bfloat16* const in1 = ((__nv_bfloat16*)args.ptr[e1]);
        __nv_bfloat16* const in2 = ((__nv_bfloat16*)args.ptr[e2]);
        float* const in3 = ((float*)(args.arena + e3));
        int* const in4 = ((int*)(ctr + e4));
        __nv_bfloat16* const out = ((__nv_bfloat16*)(args.arena + e5));
        MegaWaits wl; wl.n = 3;
        wl.ctr[0] = &ctr[e6 + (D__i0)]; wl.expected[0] = (unsigned)(2LL);
        wl.ctr[1] = &ctr[e7 + (D__i0)]; wl.expected[1] = (unsigned)(min_i64(max_i64((min_i64(((D__i1 * 64LL) + 64LL), (D_pos + 1LL)) + (D_pos * -1LL)), 0LL), 1LL));
        wl.ctr[2] = &ctr[e8 + (0LL)]; wl.expected[2] = (unsigned)(min_i64(max_i64((min_i64(((D__i1 * 64LL) + 64LL), (D_pos + 1LL)) + (D_pos * -1LL)), 0LL), 1LL));
        if (!mega_wait_all(wl)) break;
        MEGA_TRACE_WAITS_PASSED();
        attn_partial_merge<__nv_bfloat16, 64, 2>(/*smem*/ smem, /*q*/ Mat<const __nv_bfloat16>{in0, 64LL, 1LL}, /*kc*/ Ten3<const __nv_bfloat16>{in1, 65536LL, 64LL, 1LL}, /*vc*/ Ten3<const __nv_bfloat16>{in2, 65536LL, 64LL, 1LL}, /*L*/ (D_pos + 1LL), /*chunk*/ 64LL, /*scale*/ 0.125f, /*part*/ Mat<float>{(float*)in3, 1056LL, 66LL}, /*arrive*/ (unsigned*)in4, /*out*/ Mat<__nv_bfloat16>{out, 64LL, 1LL}, /*c0*/ c0, /*c1*/ c1);
        mega_sync();
        if (threadIdx.x == 0) {
          MEGA_TRACE_SIGNAL();
          mega_red_release(&ctr[e9 + (0LL)], 1u);
        }
      } break;
      case 7: {  // matvec: op8 (1 entries)
        unsigned rem = (unsigned)local;
        const long long c1 = rem % (unsigned)(4LL); rem /= (unsigned)(4LL);
        const long long c0 = rem;
        const long long D__i0 = c0; (void)D__i0; const long long D__i1 = c1; (void)D__i1;
        __nv_bfloat16* const in0 = ((__nv_bfloat16*)(args.arena + 2048));
        __nv_bfloat16* const in1 = ((__nv_bfloat16*)args.ptr[11]);
        __nv_bfloat16* const in2 = ((__nv_bfloat16*)(args.arena + 0));
        __nv_bfloat16* const out = ((__nv_bfloat16*)(args.arena + 19456));
        if (threadIdx.x == 0) {
          mega_prefetch_l2((const char*)args.ptr[11] + c1 * 32768LL, (min_i64(256LL - c1 * 64, 64LL)) * 512LL);
        }
        MegaWaits wl; wl.n = 2;
        wl.ctr[0] = &ctr[13 + (0LL)]; wl.expected[0] = (unsigned)((((((D_pos + 1LL)) + (64LL) - 1) / (64LL)) * 2LL));
        wl.ctr[1] = &ctr[0 + (0LL)]; wl.expected[1] = (unsigned)(1LL);
        matvec<__nv_bfloat16, 1, 256, 64, false, false, true, true>(/*smem*/ smem, /*x*/ Mat<const __nv_bfloat16>{(in0 + c0 * 1 * 256LL), 256LL, 1LL}, /*g*/ Vec<const __nv_bfloat16>{}, /*eps*/ 0.0f, /*w*/ Mat<const __nv_bfloat16>{in1, 256LL, 1LL}, /*w2*/ Mat<const __nv_bfloat16>{}, /*r*/ Mat<const __nv_bfloat16>{(in2 + c0 * 1 * 256LL), 256LL, 1LL}, /*xa*/ Mat<const float>{}, /*ra*/ Mat<const float>{}, /*out*/ Mat<__nv_bfloat16>{(out + c0 * 1 * 256LL), 256LL, 1LL}, /*N*/ 256LL, /*n_tile*/ c1, /*mvalid*/ min_i64(1LL, (1LL) - c0 * 1), /*wl*/ wl);
        if (mega_abort_block) break;
        MEGA_TRACE_WAITS_PASSED();
        mega_sync();
        if (threadIdx.x == 0) {
          MEGA_TRACE_SIGNAL();
          mega_red_release(&ctr[14 + (0LL)], 1u);
        }
      } break;
      case 8: {  // glu_down: op9, op18 (2 entries)
        const long long e0 = __ldg(E + 0), e1 = __ldg(E + 1), e2 = __ldg(E + 2), e3 = __ldg(E + 3), e4 = __ldg(E + 4), e5 = __ldg(E + 5), e6 = __ldg(E + 6), e7 = __ldg(E + 7), e8 = __ldg(E + 8), e9 = __ldg(E + 9);
        unsigned rem = (unsigned)local;
        const long long c1 = rem % (unsigned)(64LL); rem /= (unsigned)(64LL);
        const long long c0 = rem;
        const long long D__i0 = c0; (void)D__i0; const long long D__i1 = c1; (void)D__i1;
        __nv_bfloat16* const in0 = ((__nv_bfloat16*)(args.arena + e0));
        __nv_bfloat16* const in1 = ((__nv_bfloat16*)args.ptr[e1]);
        __nv_bfloat16* const in2 = ((__nv_bfloat16*)args.ptr[e2]);
        __nv_bfloat16* const in3 = ((__nv_bfloat16*)args.ptr[e3]);
        __nv_bfloat16* const in4 = ((__nv_bfloat16*)args.ptr[e4]);
        float* const out = ((float*)(ctr + e5));
        if (threadIdx.x == 0) {
          mega_prefetch_l2((const char*)args.ptr[e6] + c1 * 4096LL, (min_i64(512LL - c1 * 8, 8LL)) * 512LL);
          mega_prefetch_l2((const char*)args.ptr[e7] + c1 * 4096LL, (min_i64(512LL - c1 * 8, 8LL)) * 512LL);
        }
        MegaWaits wl; wl.n = 1;
        wl.ctr[0] = &ctr[e8 + (0LL)]; wl.expected[0] = (unsigned)(4LL);
        glu_down<__nv_bfloat16, 256, 256, 8, true>(/*smem*/ smem, /*x*/ Vec<const __nv_bfloat16>{in0, 1LL}, /*g*/ Vec<const __nv_bfloat16>{in1, 1LL}, /*eps*/ 1e-06f, /*w*/ Mat<const __nv_bfloat16>{in2, 256LL, 1LL}, /*w2*/ Mat<const __nv_bfloat16>{in3, 256LL, 1LL}, /*wd*/ Mat<const __nv_bfloat16>{in4, 256LL, 1LL}, /*acc*/ out, /*F*/ 512LL, /*n_tile*/ c1, /*wl*/ wl, /*scale*/ 1.0f);
        if (mega_abort_block) break;
        MEGA_TRACE_WAITS_PASSED();
        mega_sync();
        if (threadIdx.x == 0) {
          MEGA_TRACE_SIGNAL();
          mega_red_release(&ctr[e9 + (0LL)], 1u);
        }
      } break;
      case 9: {  // matvec: op10, op11 (2 entries)
        const long long e0 = __ldg(E + 0), e1 = __ldg(E + 1), e2 = __ldg(E + 2), e3 = __ldg(E + 3), e4 = __ldg(E + 4), e5 = __ldg(E + 5), e6 = __ldg(E + 6), e7 = __ldg(E + 7), e8 = __ldg(E + 8), e9 = __ldg(E + 9);
        unsigned rem = (unsigned)local;
        const long long c1 = rem % (unsigned)(e0); rem /= (unsigned)(e1);
        const long long c0 = rem;
        const long long D__i0 = c0; (void)D__i0; const long long D__i1 = c1; (void)D__i1;
        __nv_bfloat16* const in0 = ((__nv_bfloat16*)(args.arena + 19456));
        __nv_bfloat16* const in1 = ((__nv_bfloat16*)args.ptr[e2]);
        __nv_bfloat16* const in2 = ((__nv_bfloat16*)args.ptr[17]);
        float* const in3 = ((float*)(ctr + 96));
        __nv_bfloat16* const out = ((__nv_bfloat16*)(args.arena + e3));
        if (threadIdx.x == 0) {
          mega_prefetch_l2((const char*)args.ptr[e4] + c1 * 4096LL, (min_i64(e5 - c1 * 8, 8LL)) * 512LL);
        }
        MegaWaits wl; wl.n = 1;
        wl.ctr[0] = &ctr[15 + (0LL)]; wl.expected[0] = (unsigned)(64LL);
        matvec<__nv_bfloat16, 1, 256, 8, true, false, false, true>(/*smem*/ smem, /*x*/ Mat<const __nv_bfloat16>{(in0 + c0 * 1 * 256LL), 256LL, 1LL}, /*g*/ Vec<const __nv_bfloat16>{in2, 1LL}, /*eps*/ 1e-06f, /*w*/ Mat<const __nv_bfloat16>{in1, 256LL, 1LL}, /*w2*/ Mat<const __nv_bfloat16>{}, /*r*/ Mat<const __nv_bfloat16>{}, /*xa*/ Mat<const float>{(in3 + c0 * 1 * 256LL), 256LL, 1LL}, /*ra*/ Mat<const float>{}, /*out*/ Mat<__nv_bfloat16>{(out + c0 * 1 * e6), e7, 1LL}, /*N*/ e8, /*n_tile*/ c1, /*mvalid*/ min_i64(1LL, (1LL) - c0 * 1), /*wl*/ wl);
        if (mega_abort_block) break;
        MEGA_TRACE_WAITS_PASSED();
        mega_sync();
        if (threadIdx.x == 0) {
          MEGA_TRACE_SIGNAL();
          mega_red_release(&ctr[e9 + ((D__i1 / 8LL))], 1u);
        }
      } break;
      case 10: {  // matvec: op12 (1 entries)
        unsigned rem = (unsigned)local;
        const long long c1 = rem % (unsigned)(16LL); rem /= (unsigned)(16LL);
        const long long c0 = rem;
        const long long D__i0 = c0; (void)D__i0; const long long D__i1 = c1; (void)D__i1;
        __nv_bfloat16* const in0 = ((__nv_bfloat16*)(args.arena + 19456));
        __nv_bfloat16* const in1 = ((__nv_bfloat16*)args.ptr[19]);
        __nv_bfloat16* const in2 = ((__nv_bfloat16*)args.ptr[17]);
        float* const in3 = ((float*)(ctr + 96));
        __nv_bfloat16* const out = ((__nv_bfloat16*)(args.arena + 20736));
        if (threadIdx.x == 0) {
          mega_prefetch_l2((const char*)args.ptr[19] + c1 * 4096LL, (min_i64(128LL - c1 * 8, 8LL)) * 512LL);
        }
        MegaWaits wl; wl.n = 1;
        wl.ctr[0] = &ctr[15 + (0LL)]; wl.expected[0] = (unsigned)(64LL);
        matvec<__nv_bfloat16, 1, 256, 8, true, false, false, true>(/*smem*/ smem, /*x*/ Mat<const __nv_bfloat16>{(in0 + c0 * 1 * 256LL), 256LL, 1LL}, /*g*/ Vec<const __nv_bfloat16>{in2, 1LL}, /*eps*/ 1e-06f, /*w*/ Mat<const __nv_bfloat16>{in1, 256LL, 1LL}, /*w2*/ Mat<const __nv_bfloat16>{}, /*r*/ Mat<const __nv_bfloat16>{}, /*xa*/ Mat<const float>{(in3 + c0 * 1 * 256LL), 256LL, 1LL}, /*ra*/ Mat<const float>{}, /*out*/ Mat<__nv_bfloat16>{(out + c0 * 1 * 128LL), 128LL, 1LL}, /*N*/ 128LL, /*n_tile*/ c1, /*mvalid*/ min_i64(1LL, (1LL) - c0 * 1), /*wl*/ wl);
        if (mega_abort_block) break;
        MEGA_TRACE_WAITS_PASSED();
        mega_sync();
        if (threadIdx.x == 0) {
          MEGA_TRACE_SIGNAL();
          mega_red_release(&ctr[22 + (0LL)], 1u);
        }
      } break;
      case 11: {  // matvec: op17 (1 entries)
        unsigned rem = (unsigned)local;
        const long long c1 = rem % (unsigned)(4LL); rem /= (unsigned)(4LL);
        const long long c0 = rem;
        const long long D__i0 = c0; (void)D__i0; const long long D__i1 = c1; (void)D__i1;
        __nv_bfloat16* const in0 = ((__nv_bfloat16*)(args.arena + 21504));
        __nv_bfloat16* const in1 = ((__nv_bfloat16*)args.ptr[24]);
        __nv_bfloat16* const in2 = ((__nv_bfloat16*)(args.arena + 19456));
        float* const in3 = ((float*)(ctr + 96));
        __nv_bfloat16* const out = ((__nv_bfloat16*)(args.arena + 38912));
        if (threadIdx.x == 0) {
          mega_prefetch_l2((const char*)args.ptr[24] + c1 * 32768LL, (min_i64(256LL - c1 * 64, 64LL)) * 512LL);
        }
        MegaWaits wl; wl.n = 2;
        wl.ctr[0] = &ctr[28 + (0LL)]; wl.expected[0] = (unsigned)((((((D_pos + 1LL)) + (64LL) - 1) / (64LL)) * 2LL));
        wl.ctr[1] = &ctr[15 + (0LL)]; wl.expected[1] = (unsigned)(64LL);
        matvec<__nv_bfloat16, 1, 256, 64, false, false, true, true>(/*smem*/ smem, /*x*/ Mat<const __nv_bfloat16>{(in0 + c0 * 1 * 256LL), 256LL, 1LL}, /*g*/ Vec<const __nv_bfloat16>{}, /*eps*/ 0.0f, /*w*/ Mat<const __nv_bfloat16>{in1, 256LL, 1LL}, /*w2*/ Mat<const __nv_bfloat16>{}, /*r*/ Mat<const __nv_bfloat16>{(in2 + c0 * 1 * 256LL), 256LL, 1LL}, /*xa*/ Mat<const float>{}, /*ra*/ Mat<const float>{(in3 + c0 * 1 * 256LL), 256LL, 1LL}, /*out*/ Mat<__nv_bfloat16>{(out + c0 * 1 * 256LL), 256LL, 1LL}, /*N*/ 256LL, /*n_tile*/ c1, /*mvalid*/ min_i64(1LL, (1LL) - c0 * 1), /*wl*/ wl);
        if (mega_abort_block) break;
        MEGA_TRACE_WAITS_PASSED();
        mega_sync();
        if (threadIdx.x == 0) {
          MEGA_TRACE_SIGNAL();
          mega_red_release(&ctr[29 + (0LL)], 1u);
        }
      } break;
      case 12: {  // acc_residual: op19 (1 entries)
        unsigned rem = (unsigned)local;
        const long long c1 = rem % (unsigned)(1LL); rem /= (unsigned)(1LL);
        const long long c0 = rem;
        const long long D__i0 = c0; (void)D__i0; const long long D__i1 = c1; (void)D__i1;
        __nv_bfloat16* const in0 = ((__nv_bfloat16*)(args.arena + 38912));
        float* const in1 = ((float*)(ctr + 384));
        __nv_bfloat16* const out = ((__nv_bfloat16*)(args.arena + 39424));
        MegaWaits wl; wl.n = 1;
        wl.ctr[0] = &ctr[30 + (0LL)]; wl.expected[0] = (unsigned)(64LL);
        if (!mega_wait_all(wl)) break;
        MEGA_TRACE_WAITS_PASSED();
        acc_residual<__nv_bfloat16>(/*r*/ Vec<const __nv_bfloat16>{in0, 1LL}, /*acc*/ in1, /*out*/ Vec<__nv_bfloat16>{out, 1LL}, /*n*/ 256LL, /*tile*/ 1024LL, /*c1*/ c1);
        mega_sync();
        if (threadIdx.x == 0) {
          MEGA_TRACE_SIGNAL();
          mega_red_release(&ctr[31 + (0LL)], 1u);
        }
      } break;
      case 13: {  // matvec_argmax: op20 (1 entries)
        unsigned rem = (unsigned)local;
        const long long c1 = rem % (unsigned)(128LL); rem /= (unsigned)(128LL);
        const long long c0 = rem;
        const long long D__i0 = c0; (void)D__i0; const long long D__i1 = c1; (void)D__i1;
        __nv_bfloat16* const in0 = ((__nv_bfloat16*)(args.arena + 39424));
        __nv_bfloat16* const in1 = ((__nv_bfloat16*)args.ptr[29]);
        __nv_bfloat16* const in2 = ((__nv_bfloat16*)args.ptr[30]);
        float* const out = ((float*)(args.arena + 39936));
        if (threadIdx.x == 0) {
          mega_prefetch_l2((const char*)args.ptr[29] + c1 * 4096LL, (min_i64(1024LL - c1 * 8, 8LL)) * 512LL);
        }
        MegaWaits wl; wl.n = 1;
        wl.ctr[0] = &ctr[31 + (0LL)]; wl.expected[0] = (unsigned)(1LL);
        if (!mega_wait_all(wl)) break;
        MEGA_TRACE_WAITS_PASSED();
        matvec_argmax<__nv_bfloat16, 256, 8, true>(/*smem*/ smem, /*x*/ Mat<const __nv_bfloat16>{in0, 256LL, 1LL}, /*g*/ Vec<const __nv_bfloat16>{in2, 1LL}, /*eps*/ 1e-06f, /*w*/ Mat<const __nv_bfloat16>{in1, 256LL, 1LL}, /*part*/ Vec<float>{out, 2LL}, /*N*/ 1024LL, /*n_tile*/ c1);
        mega_sync();
        if (threadIdx.x == 0) {
          MEGA_TRACE_SIGNAL();
          mega_red_release(&ctr[32 + (0LL)], 1u);
        }
      } break;
      case 14: {  // argmax_reduce: op21 (1 entries)
        unsigned rem = (unsigned)local;
        const long long c0 = rem;
        const long long D__i0 = c0; (void)D__i0;
        float* const in0 = ((float*)(args.arena + 39936));
        int* const out = ((int*)(args.arena + 40960));
        MegaWaits wl; wl.n = 1;
        wl.ctr[0] = &ctr[32 + (0LL)]; wl.expected[0] = (unsigned)(128LL);
        if (!mega_wait_all(wl)) break;
        MEGA_TRACE_WAITS_PASSED();
        argmax_reduce(/*smem*/ smem, /*part*/ Mat<const float>{in0, 256LL, 2LL}, /*T*/ 128LL, /*out*/ Vec<int>{out, 1LL}, /*c0*/ c0);
      } break;
      default: break;
    }
    // the deferred kinds' bodies (render.py: deferred_slots): one inlined copy each, whichever entry ran
    
    mega_sync();
#ifdef MEGA_TRACE
    if (threadIdx.x == 0) {
      unsigned smid;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
      unsigned long long* rec = args.trace + MEGA_TRACE_WORDS * g;  // (interpreter/trace.py: Trace.records)
      rec[0] = ((unsigned long long)(MEGA_ENTRY0 + entry) << 40) | ((unsigned long long)smid << 32) | (unsigned long long)local;
      rec[1] = t_claim;
      rec[2] = t_waited ? t_waited : t_claim;
      rec[3] = mega_globaltimer();
      const long long c[] = {c_issue, c_claim, mega_c_poll, c_waited ? c_waited : c_claim, mega_c_mark, c_signal, clock64()};
      for (int i = 0; i < (int)(sizeof(c) / sizeof(c[0])); ++i) rec[4 + i] = (unsigned long long)c[i];
    }
#endif
    if (mega_abort_block) break;
  }
}
