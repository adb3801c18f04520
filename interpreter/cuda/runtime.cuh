// Interpreter runtime: the barrier protocol, bounded waits and the error record.
//
// control[] layout (u64): [0..1] claim counter per parity, [2] abort flag,
// [3] error code, [4] queue entry, [5] instance, [6] detail (wait index / value).
#pragma once
#include "common.cuh"

#define MEGA_ERR_TIMEOUT 1
#define MEGA_ERR_INDEX 2
#ifndef MEGA_ERR_NAN
#define MEGA_ERR_NAN 4  // NaN logits in sample / argmax (detail: the row); runtime.py: ERR_NAN
#endif
#ifndef MEGA_ERR_NAN_SETTING
#define MEGA_ERR_NAN_SETTING 5  // NaN temperature (detail: 2 * row) or top_p (2 * row + 1) in sample
#endif

#ifndef MEGA_TIMEOUT_NS
#define MEGA_TIMEOUT_NS 2000000000ULL  // 2 s: far beyond any legitimate wait
#endif

__device__ __forceinline__ unsigned long long mega_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned mega_ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void mega_red_release(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The same at system scope: peer counters, which other GPUs write and read (tensor parallel).
__device__ __forceinline__ unsigned mega_ld_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void mega_red_release_sys(unsigned* p, unsigned v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Which entry and instance this block is running, for error records from bodies; whether
// the block must stop (a traced kernel's stamps: common.cuh).
__shared__ int mega_abort_block;
__shared__ int mega_cur_entry;
__shared__ long long mega_cur_instance;
__device__ unsigned long long* mega_control_ptr;

__device__ void mega_record_error(unsigned long long* control, int code, int entry, long long instance,
                                  long long detail) {
  if (atomicCAS(&control[3], 0ULL, (unsigned long long)code) == 0ULL) {
    control[4] = (unsigned long long)entry;
    control[5] = (unsigned long long)instance;
    control[6] = (unsigned long long)detail;
  }
  __threadfence();
  atomicExch(&control[2], 1ULL);
}

__device__ void mega_body_error(int code, long long detail) {
  mega_record_error(mega_control_ptr, code, mega_cur_entry, mega_cur_instance, detail);
}

// A counter's value, acquired: at system scope for a peer counter (written by other GPUs).
__device__ __forceinline__ unsigned mega_ld_counter(const unsigned* p, bool sys) {
#if MEGA_PEERS
  return sys ? mega_ld_acquire_sys(p) : mega_ld_acquire(p);
#else
  return (void)sys, mega_ld_acquire(p);  // (one GPU: every counter is this GPU's)
#endif
}

// Whether wait i of w reads a peer counter (system scope).
__device__ __forceinline__ bool mega_wait_sys(const MegaWaits& w, int i) {
#if MEGA_PEERS
  return (w.sys >> i) & 1;
#else
  return (void)w, (void)i, false;
#endif
}

#ifndef MEGA_SPIN_SLEEP_MAX
// ns: the spin's back-off doubles from 32 up to this. 32 (no back-off) measured 0.1-0.9% faster than
// 256 on an H100, 1024 1% slower (perf-notes #61; #17 saw no difference when hops were slower)
#define MEGA_SPIN_SLEEP_MAX 32
#endif

// The spin after a first look that failed: one copy, called (the first look stays inline).
__device__ __noinline__ bool mega_wait_spin(const unsigned* counter, unsigned expected, unsigned long long* control,
                                            int entry, long long instance, int wait_id, bool sys) {
  const unsigned long long t0 = mega_globaltimer();
  unsigned sleep = 32;
  while (mega_ld_counter(counter, sys) < expected) {
    if (*(volatile unsigned long long*)&control[2]) return false;
    if (mega_globaltimer() - t0 > MEGA_TIMEOUT_NS) {
      mega_record_error(control, MEGA_ERR_TIMEOUT, entry, instance, wait_id);
      return false;
    }
    __nanosleep(sleep);
    if (sleep < MEGA_SPIN_SLEEP_MAX) sleep *= 2;
  }
  return true;
}

// Spin until *counter >= expected (acquire; at system scope for a peer counter). False on abort or
// timeout (error recorded).
__device__ __forceinline__ bool mega_wait(const unsigned* counter, unsigned expected, unsigned long long* control,
                                          int entry, long long instance, int wait_id, bool sys = false) {
  return mega_ld_counter(counter, sys) >= expected || mega_wait_spin(counter, expected, control, entry, instance, wait_id, sys);
}

// The first MEGA_PREFETCH_BYTES of an instance's weight tile into L2 (common.cuh: mega_prefetch_l2_range),
// issued before its barrier wait, so the handoff latency of the previous op overlaps this op's weights.
#define MEGA_PREFETCH_BYTES 16384LL  // per operand (A/B on llama-1b: 0: 1.430 ms, 16K: 1.417, 64K: 1.434, whole tile: 1.514)
__device__ __forceinline__ void mega_prefetch_l2(const void* p, long long bytes) {
  mega_prefetch_l2_range(p, bytes > MEGA_PREFETCH_BYTES ? MEGA_PREFETCH_BYTES : bytes);
}

__device__ bool mega_waits_met(const MegaWaits& w) {
    MEGA_TRACE_POLL();
    const bool met = threadIdx.x >= w.n || mega_ld_counter(w.ctr[threadIdx.x], mega_wait_sys(w, threadIdx.x)) >= w.expected[threadIdx.x];
    return mega_sync_and(met);
}

__device__ bool mega_wait_all(const MegaWaits& w) {
    if (w.n == 0) return true;
    MEGA_TRACE_POLL();
    if (threadIdx.x < w.n && !mega_wait(w.ctr[threadIdx.x], w.expected[threadIdx.x], mega_control_ptr, mega_cur_entry,
                                        mega_cur_instance, threadIdx.x, mega_wait_sys(w, threadIdx.x)))
        mega_abort_block = 1;
    mega_sync();
#ifdef MEGA_TRACE
    if (threadIdx.x == 0) mega_t_waited = mega_globaltimer(), mega_c_waited = clock64();
#endif
    return !mega_abort_block;
}
