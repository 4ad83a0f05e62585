// Batch-1 decode layers of Qwen3-0.6B's shape as one persistent CUDA kernel (an experiment,
// driven by cuda_layer_chain.py; the engine does not use it).
//
// The Triton persistent kernel (persistent_layers.py) tied the engine's chain of launches
// because each program could hold only one tile of the next phase's weights, in registers.
// Here one warp per block streams the block's weight slices for every phase of every layer
// into a ring of shared-memory slots with bulk copies (cp.async.bulk, completing on an
// mbarrier), running as far ahead as the ring allows, while the other warps compute. The
// weight stream never waits on the grid barriers; only the small input vectors do.
//
// Per layer, four phases meet at grid barriers (attention is left out, as in
// split_decode_chain.py's "none" variant: o_proj reads q as the qkv projection wrote it):
//   0  qkv[r]      = (W_qkv'[r] . h) * rsqrt(mean(h^2) + eps)     (norm weight folded in W)
//   1  h[r]        = h[r] + bf16(W_o[r] . q)
//   2  act[f]      = silu(g) * u, g/u = (W_gu'[2f] / W_gu'[2f+1] . h) * rsqrt(mean(h^2) + eps)
//   3  h[r]        = h[r] + bf16(W_down[r] . act)
// Block b owns rows [b*N/G, (b+1)*N/G) of each phase (features for phase 2), so each slice is
// contiguous in the row-major weight and copies as whole rows.

#include <cuda_bf16.h>
#include <stdint.h>

namespace {

constexpr int HIDDEN = 1024;
constexpr int QKV = 4096;
constexpr int Q = 2048;
constexpr int INTER = 3072;
constexpr int PHASES = 4;

// Tunings the driver sets with -D; these defaults fill 208 KB of shared memory.
#ifndef CONSUMER_WARPS
#define CONSUMER_WARPS 8
#endif
#ifndef SLOT_BYTES
#define SLOT_BYTES 16384
#endif
#ifndef SLOTS
#define SLOTS 13
#endif
// EVICT_FIRST marks the weight copies evict-first in L2 (read once per forward).
#ifndef EVICT_FIRST
#define EVICT_FIRST 0
#endif
// Timing aids, each making the results wrong: STREAM_ONLY leaves the consumers nothing but
// waiting for each slot and releasing it (the weight stream's own pace), NO_WEIGHTS skips the
// weight stream (the barriers' and vectors' pace).
#ifndef STREAM_ONLY
#define STREAM_ONLY 0
#endif
#ifndef NO_WEIGHTS
#define NO_WEIGHTS 0
#endif
constexpr int CONSUMERS = CONSUMER_WARPS * 32;
constexpr int THREADS = CONSUMERS + 32;  // the last warp streams the weights
// Polls before a wait gives up and flags the launch, so a bug fails the check instead of
// hanging the device; once flagged, every wait gives up at its next look at the flag.
constexpr uint32_t SPIN_LIMIT = 1u << 22;
constexpr uint32_t FLAG_EVERY = 1024;

struct Phase {
  const __nv_bfloat16* weight;  // this layer's [rows, k] weight
  int first_row;                // this block's slice
  int end_row;
  int k;
};

__device__ __forceinline__ Phase phase_slice(int phase, int layer, const __nv_bfloat16* w_qkv,
                                             const __nv_bfloat16* w_o,
                                             const __nv_bfloat16* w_gate_up,
                                             const __nv_bfloat16* w_down) {
  const int b = blockIdx.x, g = gridDim.x;
  switch (phase) {
    case 0:
      return {w_qkv + (size_t)layer * QKV * HIDDEN, b * QKV / g, (b + 1) * QKV / g, HIDDEN};
    case 1:
      return {w_o + (size_t)layer * HIDDEN * Q, b * HIDDEN / g, (b + 1) * HIDDEN / g, Q};
    case 2:
      return {w_gate_up + (size_t)layer * 2 * INTER * HIDDEN, 2 * (b * INTER / g),
              2 * ((b + 1) * INTER / g), HIDDEN};
    default:
      return {w_down + (size_t)layer * HIDDEN * INTER, b * HIDDEN / g, (b + 1) * HIDDEN / g,
              INTER};
  }
}

__device__ __forceinline__ int rows_per_slot(int k) { return SLOT_BYTES / (k * 2); }

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)),
               "r"(count));
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar))
               : "memory");
}

__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                   shared_address(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity, int* failed) {
  uint32_t done = 0;
  for (uint32_t spins = 0; !done; ++spins) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
    if (spins == SPIN_LIMIT) atomicExch(failed, 1);
    if (spins % FLAG_EVERY == FLAG_EVERY - 1 && *(volatile int*)failed) return;
  }
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  if (EVICT_FIRST) {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1], %2, [%3], %4;" ::"r"(shared_address(dst)),
        "l"(src), "r"(bytes), "r"(shared_address(bar)), "l"(policy)
        : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(shared_address(dst)),
        "l"(src), "r"(bytes), "r"(shared_address(bar))
        : "memory");
  }
}

__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");
}

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Grid barrier on a counter that only grows: the n-th barrier of a launch waits for n * grid
// arrivals. Called by every consumer thread; thread 0 does the global part. The release add
// publishes the block's stores (ordered before it by bar.sync), the acquire poll makes the
// other blocks' visible to the block (ordered after it by bar.sync); no separate fences.
__device__ __forceinline__ void grid_arrive(unsigned int* arrived) {
  consumers_sync();
  if (threadIdx.x == 0)
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(arrived) : "memory");
}

__device__ __forceinline__ void grid_wait(unsigned int* arrived, unsigned int target,
                                          int* failed) {
  if (threadIdx.x == 0) {
    unsigned int seen = 0;
    for (uint32_t spins = 0;; ++spins) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(arrived) : "memory");
      if (seen >= target) break;
      if (spins == SPIN_LIMIT) atomicExch(failed, 1);
      if (spins % FLAG_EVERY == FLAG_EVERY - 1 && *(volatile int*)failed) break;
    }
  }
  consumers_sync();
}

// The phase's input vector, read from L2 once per block into shared memory (every warp of
// every block reading it from L2 makes its few lines a hot spot: ~1 µs, run 200), then each
// lane's share into registers: 16-byte pieces (j * 32 + lane) * 8, so that a warp reads 512
// contiguous bytes per step, as it does from a weight row.
template <int K>
__device__ __forceinline__ void load_vector(const __nv_bfloat16* v, uint4* staged, int lane,
                                            float (&x)[K / 32]) {
  for (int i = threadIdx.x; i < K / 8; i += CONSUMERS)
    staged[i] = __ldcg(reinterpret_cast<const uint4*>(v) + i);
  consumers_sync();
#pragma unroll
  for (int j = 0; j < K / 256; ++j) {
    uint4 piece = staged[j * 32 + lane];
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&piece);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float2 f = __bfloat1622float2(pairs[e]);
      x[j * 8 + 2 * e] = f.x;
      x[j * 8 + 2 * e + 1] = f.y;
    }
  }
}

// This lane's part of a shared-memory row's dot product with x; warp_sum finishes it.
template <int K>
__device__ __forceinline__ float lane_dot(const uint8_t* row, int lane, const float (&x)[K / 32]) {
  float acc[8] = {};  // independent chains, so the FMAs overlap
#pragma unroll
  for (int j = 0; j < K / 256; ++j) {
    uint4 piece = reinterpret_cast<const uint4*>(row)[j * 32 + lane];
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&piece);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float2 w = __bfloat1622float2(pairs[e]);
      acc[2 * e] = fmaf(w.x, x[j * 8 + 2 * e], acc[2 * e]);
      acc[2 * e + 1] = fmaf(w.y, x[j * 8 + 2 * e + 1], acc[2 * e + 1]);
    }
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// Butterfly sums of n independent values at once, so their shuffles overlap.
template <int N>
__device__ __forceinline__ void warp_sum(float (&v)[N]) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], offset);
  }
}

template <int K>
__device__ __forceinline__ float rms_scale(const float (&x)[K / 32], float eps) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < K / 32; ++i) ss = fmaf(x[i], x[i], ss);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, offset);
  return rsqrtf(ss / K + eps);
}

__device__ __forceinline__ float add_rounded(float h, float product) {
  // As F.linear(...) + residual rounds: the product to bf16 first, then the sum.
  return __bfloat162float(
      __float2bfloat16(h + __bfloat162float(__float2bfloat16(product))));
}

// The fewest blocks the launch may have: it bounds the rows (phase 2: features) a warp owns
// in a phase, which its registers hold.
constexpr int MIN_GRID = 128;
__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int units_per_warp(int n) { return ceil_div(ceil_div(n, MIN_GRID), CONSUMER_WARPS); }
constexpr int OWN_ROWS = units_per_warp(HIDDEN);  // residual rows a warp updates
// With slot_stamps, per block and slot of the sequence (sized for MIN_GRID's slices): the
// SM clock when the producer issued the copy, and when the warp owning the slot's first row
// began and ended waiting for it.
constexpr int SLOTS_PER_LAYER = ceil_div(ceil_div(QKV, MIN_GRID), SLOT_BYTES / (HIDDEN * 2)) +
                                ceil_div(ceil_div(HIDDEN, MIN_GRID), SLOT_BYTES / (Q * 2)) +
                                ceil_div(2 * ceil_div(INTER, MIN_GRID), SLOT_BYTES / (HIDDEN * 2)) +
                                ceil_div(ceil_div(HIDDEN, MIN_GRID), SLOT_BYTES / (INTER * 2));
constexpr int SLOT_STAMPS = 3;

// Per block, phase and layer: globaltimer as the barrier is passed, then SM clocks as the
// barrier is passed, x is loaded, the first weights are in, the sums are done, the block
// has arrived; and globaltimer again at arrival.
enum Stamp { GT_START, CLK_START, CLK_X, CLK_WEIGHTS, CLK_SUMS, CLK_ARRIVED, GT_DONE, STAMPS };

__device__ __forceinline__ void stamp_clock(uint64_t* stamp, int which) {
  if (stamp != nullptr && threadIdx.x == 0) stamp[which] = clock64();
}

// One phase's slots, in the producer's order. Warp w owns the slice's units (rows; phase 2:
// gate/up row pairs) w, w + CONSUMER_WARPS, ...: it waits only on the slots that hold them,
// releases every slot once past it (so the producer reuses a slot when all warps are), and
// sums its units' dot products in one butterfly at the end. Phases 1 and 3 add into the
// block's residual rows, which the warp keeps in `own` (lane 0) across phases and layers.
template <int K, int PHASE, int UNITS>
__device__ __forceinline__ void consume_phase(const Phase& ph, const float (&x)[K / 32],
                                              float scale, uint8_t* ring, uint64_t* full,
                                              uint64_t* empty, uint32_t& seq,
                                              __nv_bfloat16* out, float (&own)[OWN_ROWS],
                                              int* failed, uint64_t* stamp,
                                              uint64_t* slot_stamps, int layers) {
  constexpr int PER_SLOT = SLOT_BYTES / (K * 2);
  constexpr int UNIT_ROWS = PHASE == 2 ? 2 : 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rows = ph.end_row - ph.first_row;
  const int units = rows / UNIT_ROWS, slots = ceil_div(rows, PER_SLOT);
  float sums[UNITS * UNIT_ROWS];
  int released = 0;
#pragma unroll
  for (int t = 0; t < UNITS; ++t) {
    const int unit = warp + t * CONSUMER_WARPS;
    if (unit < units) {
      const int slot_index = unit * UNIT_ROWS / PER_SLOT;
      for (; released < slot_index; ++released) {
        __syncwarp();
        if (lane == 0 && !NO_WEIGHTS) mbarrier_arrive(&empty[(seq + released) % SLOTS]);
      }
      const uint32_t s = seq + slot_index;
      uint64_t* slot_stamp = slot_stamps != nullptr && lane == 0 && unit * UNIT_ROWS == slot_index * PER_SLOT
                                 ? slot_stamps + ((size_t)blockIdx.x * layers * SLOTS_PER_LAYER + s) * SLOT_STAMPS
                                 : nullptr;
      if (slot_stamp != nullptr) slot_stamp[1] = clock64();
      if (!NO_WEIGHTS) mbarrier_wait(&full[s % SLOTS], (s / SLOTS) & 1, failed);
      if (slot_stamp != nullptr) slot_stamp[2] = clock64();
      if (t == 0) stamp_clock(stamp, CLK_WEIGHTS);
      const uint8_t* row =
          ring + (s % SLOTS) * SLOT_BYTES + (unit * UNIT_ROWS - slot_index * PER_SLOT) * K * 2;
#pragma unroll
      for (int r = 0; r < UNIT_ROWS; ++r)
        sums[t * UNIT_ROWS + r] = STREAM_ONLY ? 0.f : lane_dot<K>(row + r * K * 2, lane, x);
    } else {
#pragma unroll
      for (int r = 0; r < UNIT_ROWS; ++r) sums[t * UNIT_ROWS + r] = 0.f;
    }
  }
  for (; released < slots; ++released) {
    __syncwarp();
    if (lane == 0 && !NO_WEIGHTS) mbarrier_arrive(&empty[(seq + released) % SLOTS]);
  }
  seq += slots;
  warp_sum(sums);
  stamp_clock(stamp, CLK_SUMS);
  if (lane != 0) return;
#pragma unroll
  for (int t = 0; t < UNITS; ++t) {
    const int unit = warp + t * CONSUMER_WARPS;
    if (unit >= units) continue;
    if (PHASE == 0) {
      out[ph.first_row + unit] = __float2bfloat16(sums[t] * scale);
    } else if (PHASE == 2) {
      const float g = sums[2 * t] * scale, u = sums[2 * t + 1] * scale;
      out[ph.first_row / 2 + unit] = __float2bfloat16(g / (1.f + __expf(-g)) * u);
    } else {
      own[t] = add_rounded(own[t], sums[t]);
      out[ph.first_row + unit] = __float2bfloat16(own[t]);
    }
  }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    layer_chain(const __nv_bfloat16* __restrict__ w_qkv, const __nv_bfloat16* __restrict__ w_o,
                const __nv_bfloat16* __restrict__ w_gate_up,
                const __nv_bfloat16* __restrict__ w_down, __nv_bfloat16* residual,
                __nv_bfloat16* qkv, __nv_bfloat16* act, unsigned int* arrived, int* failed,
                uint64_t* stamps, uint64_t* slot_stamps, int layers, float eps) {
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ uint64_t full[SLOTS];
  __shared__ uint64_t empty[SLOTS];
  __shared__ uint4 staged[INTER / 8];  // the phase's input vector

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (gridDim.x < MIN_GRID) {
    if (threadIdx.x == 0) atomicExch(failed, 1);
    return;
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < SLOTS; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], CONSUMER_WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == CONSUMER_WARPS) {  // the weight stream
    if (lane != 0 || NO_WEIGHTS) return;
    uint32_t seq = 0;
    for (int layer = 0; layer < layers; ++layer) {
      for (int p = 0; p < PHASES; ++p) {
        const Phase ph = phase_slice(p, layer, w_qkv, w_o, w_gate_up, w_down);
        const int per_slot = rows_per_slot(ph.k);
        for (int first = ph.first_row; first < ph.end_row; first += per_slot, ++seq) {
          const int slot = seq % SLOTS;
          if (seq >= SLOTS) mbarrier_wait(&empty[slot], (seq / SLOTS - 1) & 1, failed);
          const uint32_t bytes = min(per_slot, ph.end_row - first) * ph.k * 2;
          if (slot_stamps != nullptr)
            slot_stamps[((size_t)blockIdx.x * layers * SLOTS_PER_LAYER + seq) * SLOT_STAMPS] = clock64();
          mbarrier_expect_bytes(&full[slot], bytes);
          bulk_copy(ring + slot * SLOT_BYTES, ph.weight + (size_t)first * ph.k, bytes,
                    &full[slot]);
        }
      }
    }
    return;
  }

  // The residual rows this warp updates in phases 1 and 3 (the same partition of HIDDEN).
  float own[OWN_ROWS];
  {
    const Phase ph = phase_slice(1, 0, w_qkv, w_o, w_gate_up, w_down);
#pragma unroll
    for (int t = 0; t < OWN_ROWS; ++t) {
      const int row = ph.first_row + warp + t * CONSUMER_WARPS;
      own[t] = row < ph.end_row ? __bfloat162float(residual[row]) : 0.f;
    }
  }
  uint32_t seq = 0;
  unsigned int barriers = 0;
  for (int layer = 0; layer < layers; ++layer) {
    for (int p = 0; p < PHASES; ++p) {
      if (layer + p > 0 && !STREAM_ONLY) grid_wait(arrived, ++barriers * gridDim.x, failed);
      uint64_t* stamp = stamps == nullptr
                            ? nullptr
                            : stamps + ((size_t)blockIdx.x * layers * PHASES + layer * PHASES + p) *
                                           STAMPS;
      if (stamp != nullptr && threadIdx.x == 0) stamp[GT_START] = now_ns();
      stamp_clock(stamp, CLK_START);
      const Phase ph = phase_slice(p, layer, w_qkv, w_o, w_gate_up, w_down);
      if (p == 0 || p == 2) {
        float x[HIDDEN / 32];
        if (!STREAM_ONLY) load_vector<HIDDEN>(residual, staged, lane, x);
        const float scale = STREAM_ONLY ? 0.f : rms_scale<HIDDEN>(x, eps);
        stamp_clock(stamp, CLK_X);
        if (p == 0)
          consume_phase<HIDDEN, 0, units_per_warp(QKV)>(ph, x, scale, ring, full, empty, seq,
                                                        qkv, own, failed, stamp,
            slot_stamps, layers);
        else
          consume_phase<HIDDEN, 2, units_per_warp(INTER)>(ph, x, scale, ring, full, empty, seq,
                                                          act, own, failed, stamp,
            slot_stamps, layers);
      } else if (p == 1) {
        float x[Q / 32];
        if (!STREAM_ONLY) load_vector<Q>(qkv, staged, lane, x);
        stamp_clock(stamp, CLK_X);
        consume_phase<Q, 1, OWN_ROWS>(ph, x, 1.f, ring, full, empty, seq, residual, own, failed,
                                      stamp, slot_stamps, layers);
      } else {
        float x[INTER / 32];
        if (!STREAM_ONLY) load_vector<INTER>(act, staged, lane, x);
        stamp_clock(stamp, CLK_X);
        consume_phase<INTER, 3, OWN_ROWS>(ph, x, 1.f, ring, full, empty, seq, residual, own,
                                          failed, stamp, slot_stamps, layers);
      }
      if (!STREAM_ONLY) grid_arrive(arrived);
      stamp_clock(stamp, CLK_ARRIVED);
      if (stamp != nullptr && threadIdx.x == 0) stamp[GT_DONE] = now_ns();
    }
  }
}
