// Batch-1 decode layers of Qwen3-0.6B's shape as one persistent CUDA kernel (an experiment,
// driven by cuda_layer_chain.py; the engine does not use it).
//
// The Triton persistent kernel (persistent_layers.py) tied the engine's chain of launches
// because each program could hold only one tile of the next phase's weights, in registers.
// Here one warp per block streams the block's weight slices for every phase of every layer
// into a ring of shared-memory slots with bulk copies (cp.async.bulk, completing on an
// mbarrier), running ahead as far as the ring allows, while the other warps compute. The
// weight stream never waits on the grid barriers; only the small input vectors do.
//
// Per layer, four phases meet at grid barriers (attention is left out, as in
// split_decode_chain.py's "none" variant: o_proj reads q as the qkv projection wrote it):
//   0  qkv[r]      = (W_qkv'[r] . h) * rsqrt(mean(h^2) + eps)     (norm weight folded in W)
//   1  h[r]        = h[r] + bf16(W_o[r] . q)
//   2  act[f]      = silu(g) * u, g/u = (W_gu'[2f] / W_gu'[2f+1] . h) * rsqrt(mean(h^2) + eps)
//   3  h[r]        = h[r] + bf16(W_down[r] . act)
//
// The dot products run on the tensor cores (mma m16n8k16, bf16 in, fp32 sums): a group of 8
// weight rows is the A operand (its other 8 rows zero) and the input vector, the same in every
// column, is B. The host stores each weight in fragment order, so that a lane's A fragments
// for two k-steps are one 16-byte shared-memory load and a warp's loads are 512 contiguous
// bytes: group g of 8 rows, then per 32 columns p, per lane (r = lane / 4, c = lane % 4), the
// 8 values W[8g + r][32p + 16q + 8h + 2c + e] in (q, h, e) order. Block b owns groups
// [b*NG/G, (b+1)*NG/G) of each phase (NG = rows / 8), a contiguous slice of the weight.

#include <cuda_bf16.h>
#include <stdint.h>

namespace {

constexpr int HIDDEN = 1024;
constexpr int QKV = 4096;
constexpr int Q = 2048;
constexpr int INTER = 3072;
constexpr int PHASES = 4;
constexpr int GROUP_ROWS = 8;

// Tunings the driver sets with -D.
#ifndef CONSUMER_WARPS
#define CONSUMER_WARPS 8
#endif
#ifndef SLOTS
#define SLOTS 13  // 208 KB of shared memory
#endif
// INFLIGHT > 0 caps the block's copies in flight: the producer waits for the copy issued
// INFLIGHT before to land before it issues the next. Unmetered, the blocks refill their freed
// slots all at once as a phase ends (12.7 MB after gate/up), and the next phase's loads,
// stores and barrier atomics queue behind that burst (run 205, CUDA-core dot products: 14.35
// µs a layer unmetered, 13.05 at two copies, 13.1 at three or four, 13.2 at one).
#ifndef INFLIGHT
#define INFLIGHT 2
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
// One slot holds 32 column blocks of 32 of one row group: a group's 1024 columns.
constexpr int SLOT_BYTES = 16384;
constexpr int SLOT_BLOCKS = 32;
constexpr int BLOCKS_PER_WARP = SLOT_BLOCKS / CONSUMER_WARPS;
// Polls before a wait gives up and flags the launch, so a bug fails the check instead of
// hanging the device; once flagged, every wait gives up at its next look at the flag.
constexpr uint32_t SPIN_LIMIT = 1u << 22;
constexpr uint32_t FLAG_EVERY = 1024;

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
// The fewest blocks the launch may have: it bounds the row groups a block owns in a phase,
// whose sums its warps hold in registers.
constexpr int MIN_GRID = 128;
constexpr int MAX_GROUPS = ceil_div(2 * INTER / GROUP_ROWS, MIN_GRID);  // gate/up's, the most
constexpr int MAX_ROWS = MAX_GROUPS * GROUP_ROWS;

// Per block, phase and layer: globaltimer as the barrier is passed, then SM clocks as the
// barrier is passed, the inputs are in (slots and vector), the outputs are stored, the block
// has arrived; and globaltimer again at arrival.
enum Stamp { GT_START, CLK_START, CLK_INPUTS, CLK_SUMS, CLK_ARRIVED, GT_DONE, STAMPS };

struct Phase {
  const __nv_bfloat16* weight;  // this layer's weight, fragment order
  int first_group;              // this block's slice
  int groups;
  int k;
  __device__ int slots() const { return groups * k / 1024; }
  __device__ int first_row() const { return first_group * GROUP_ROWS; }
};

__device__ __forceinline__ Phase phase_slice(int phase, int layer, const __nv_bfloat16* w_qkv,
                                             const __nv_bfloat16* w_o,
                                             const __nv_bfloat16* w_gate_up,
                                             const __nv_bfloat16* w_down) {
  const __nv_bfloat16* weight;
  int rows, k;
  switch (phase) {
    case 0: weight = w_qkv, rows = QKV, k = HIDDEN; break;
    case 1: weight = w_o, rows = HIDDEN, k = Q; break;
    case 2: weight = w_gate_up, rows = 2 * INTER, k = HIDDEN; break;
    default: weight = w_down, rows = HIDDEN, k = INTER;
  }
  const int n = rows / GROUP_ROWS, b = blockIdx.x, g = gridDim.x;
  const int first = b * n / g;
  return {weight + (size_t)layer * rows * k, first, (b + 1) * n / g - first, k};
}

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
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar))
      : "memory");
}

__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");
}

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void stamp_clock(uint64_t* stamp, int which) {
  if (stamp != nullptr && threadIdx.x == 0) stamp[which] = clock64();
}

// Grid barrier on a counter that only grows: the n-th barrier of a launch waits for n * grid
// arrivals. Called by every consumer thread; thread 0 does the global part. The release add
// publishes the block's stores (ordered before it by bar.sync), the acquire poll makes the
// other blocks' visible to the block (ordered after it by bar.sync); no separate fences.
__device__ __forceinline__ void grid_arrive(unsigned int* arrived) {
  consumers_sync();
  if (threadIdx.x == 0 && !STREAM_ONLY)
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

// Waits for slots [seq, seq + slots), thread i for the i-th, so that the waits overlap (a warp
// waiting on each of its slots in turn cost ~0.1 µs a wait, run 202); the consumers' barrier
// after it makes the copies visible to all of them.
__device__ __forceinline__ void wait_slots(uint64_t* full, uint32_t seq, int slots, int* failed) {
  if (!NO_WEIGHTS && (int)threadIdx.x < slots) {
    const uint32_t s = seq + threadIdx.x;
    mbarrier_wait(&full[s % SLOTS], (s / SLOTS) & 1, failed);
  }
}

// Hands slots [seq, seq + slots) back to the producer, lane 0 of warp i the i-th; called
// after a barrier among the consumers that follows their last read of the slots.
__device__ __forceinline__ void release_slots(uint64_t* empty, uint32_t seq, int slots) {
  if (threadIdx.x % 32 == 0 && !NO_WEIGHTS) {
    for (int i = threadIdx.x / 32; i < slots; i += CONSUMER_WARPS)
      mbarrier_arrive(&empty[(seq + i) % SLOTS]);
  }
}

// The phase's input vector, read from L2 once per block (every warp of every block reading it
// makes its few lines a hot spot: ~1 µs, run 200) into shared memory in the B fragments'
// order: per 32 columns p and lane column c, the 8 values x[32p + 16q + 8h + 2c + e] in
// (q, h, e) order, so that a lane's B fragments for two k-steps are one 16-byte load. Also
// waits for the phase's weight slots. Returns rsqrt(mean(x^2) + eps) when RMS.
template <int K, bool RMS>
__device__ __forceinline__ float load_inputs(const __nv_bfloat16* v, uint32_t* staged,
                                             float* warp_sums, uint64_t* full, uint32_t seq,
                                             int slots, float eps, int* failed) {
  constexpr int WORDS = K / 2, PER_THREAD = ceil_div(WORDS, CONSUMERS);
  uint32_t words[PER_THREAD];
  float squares = 0.f;
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i) {
    const int w = threadIdx.x + i * CONSUMERS;
    if (w < WORDS) words[i] = __ldcg(reinterpret_cast<const unsigned int*>(v) + w);
  }
  wait_slots(full, seq, slots, failed);
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i) {
    const int w = threadIdx.x + i * CONSUMERS;
    if (w >= WORDS) continue;
    const int k = 2 * w, p = k / 32, r = k % 32;
    const int q = r / 16, h = (r / 8) % 2, c = (r / 2) % 4;
    staged[(p * 4 + c) * 4 + q * 2 + h] = words[i];
    if (RMS) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]));
      squares = fmaf(f.x, f.x, fmaf(f.y, f.y, squares));
    }
  }
  if (RMS) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      squares += __shfl_xor_sync(0xffffffffu, squares, offset);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = squares;
  }
  consumers_sync();
  if (!RMS) return 1.f;
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < CONSUMER_WARPS; ++w) total += warp_sums[w];
  return rsqrtf(total / K + eps);
}

__device__ __forceinline__ void mma_rows(float (&acc)[4], uint32_t a0, uint32_t a2, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

// The block's row sums for the phase, into `sums` (shared memory, one per row of the slice).
// Warp w takes column blocks [w, w + 1) * BLOCKS_PER_WARP of every slot, so every warp adds
// into every row group; its partial sums meet in `partials`. Each slot (1024 columns of one
// group) and each of a column block's two k-steps has its own accumulator: one accumulator
// per group made a chain of up to 24 dependent mma's, ~30 cycles each (run 207's profile).
template <int K>
__device__ __forceinline__ void row_sums(const Phase& ph, const uint8_t* ring, uint32_t seq,
                                         const uint32_t* staged, float* partials, float* sums) {
  constexpr int SLOTS_PER_GROUP = K / 1024;
  constexpr int MAX_SLOTS = MAX_GROUPS;  // a phase's slots: 4 / 2 / 6 / 3 from MIN_GRID blocks
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slots = ph.groups * SLOTS_PER_GROUP;
  float acc[MAX_SLOTS][2][4] = {};
#pragma unroll
  for (int u = 0; u < BLOCKS_PER_WARP; ++u) {
    const int block = warp * BLOCKS_PER_WARP + u;
#pragma unroll
    for (int v = 0; v < MAX_SLOTS; ++v) {
      if (v < slots) {
        const uint8_t* slot = ring + ((seq + v) % SLOTS) * SLOT_BYTES;
        const uint4 a = reinterpret_cast<const uint4*>(slot)[block * 32 + lane];
        const uint4 b = reinterpret_cast<const uint4*>(
            staged)[((v % SLOTS_PER_GROUP) * SLOT_BLOCKS + block) * 4 + lane % 4];
        mma_rows(acc[v][0], a.x, a.y, b.x, b.y);
        mma_rows(acc[v][1], a.z, a.w, b.z, b.w);
      }
    }
  }
  if (lane % 4 == 0) {
#pragma unroll
    for (int g = 0; g < MAX_GROUPS; ++g) {
      if (g >= ph.groups) continue;
      float total = 0.f;
#pragma unroll
      for (int s = 0; s < SLOTS_PER_GROUP; ++s) {
        if (g * SLOTS_PER_GROUP + s < MAX_SLOTS)
          total += acc[g * SLOTS_PER_GROUP + s][0][0] + acc[g * SLOTS_PER_GROUP + s][1][0];
      }
      partials[warp * MAX_ROWS + g * GROUP_ROWS + lane / 4] = total;
    }
  }
  consumers_sync();
  for (int row = threadIdx.x; row < ph.groups * GROUP_ROWS; row += CONSUMERS) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < CONSUMER_WARPS; ++w) total += partials[w * MAX_ROWS + row];
    sums[row] = total;
  }
  consumers_sync();
}

__device__ __forceinline__ float add_rounded(float h, float product) {
  // As F.linear(...) + residual rounds: the product to bf16 first, then the sum.
  return __bfloat162float(__float2bfloat16(h + __bfloat162float(__float2bfloat16(product))));
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    layer_chain(const __nv_bfloat16* __restrict__ w_qkv, const __nv_bfloat16* __restrict__ w_o,
                const __nv_bfloat16* __restrict__ w_gate_up,
                const __nv_bfloat16* __restrict__ w_down, __nv_bfloat16* residual,
                __nv_bfloat16* qkv, __nv_bfloat16* act, unsigned int* arrived, int* failed,
                uint64_t* stamps, int layers, float eps) {
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ uint64_t full[SLOTS];
  __shared__ uint64_t empty[SLOTS];
  __shared__ __align__(16) uint32_t staged[INTER / 2];  // the phase's input vector
  __shared__ float partials[CONSUMER_WARPS * MAX_ROWS];
  __shared__ float sums[MAX_ROWS];
  __shared__ float warp_sums[CONSUMER_WARPS];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (gridDim.x < MIN_GRID) {
    if (threadIdx.x == 0) atomicExch(failed, 1);
    return;
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < SLOTS; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], 1);
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
        const uint8_t* source = reinterpret_cast<const uint8_t*>(ph.weight) +
                                (size_t)ph.first_group * GROUP_ROWS * ph.k * 2;
        for (int j = 0; j < ph.slots(); ++j, ++seq) {
          const int slot = seq % SLOTS;
          if (seq >= SLOTS) mbarrier_wait(&empty[slot], (seq / SLOTS - 1) & 1, failed);
          if (INFLIGHT > 0 && seq >= INFLIGHT) {
            const uint32_t landed = seq - INFLIGHT;
            mbarrier_wait(&full[landed % SLOTS], (landed / SLOTS) & 1, failed);
          }
          mbarrier_expect_bytes(&full[slot], SLOT_BYTES);
          bulk_copy(ring + slot * SLOT_BYTES, source + (size_t)j * SLOT_BYTES, SLOT_BYTES,
                    &full[slot]);
        }
      }
    }
    return;
  }

  // Thread t keeps residual row t of its slice of phases 1 and 3 (the same partition).
  float own = 0.f;
  {
    const Phase ph = phase_slice(1, 0, w_qkv, w_o, w_gate_up, w_down);
    if ((int)threadIdx.x < ph.groups * GROUP_ROWS)
      own = __bfloat162float(residual[ph.first_row() + threadIdx.x]);
  }
  uint32_t seq = 0;
  unsigned int barriers = 0;
  for (int layer = 0; layer < layers; ++layer) {
#pragma unroll  // each phase's slice then folds to constants, hoisted out of the layer loop
    for (int p = 0; p < PHASES; ++p) {
      if (layer + p > 0 && !STREAM_ONLY) grid_wait(arrived, ++barriers * gridDim.x, failed);
      uint64_t* stamp = stamps == nullptr
                            ? nullptr
                            : stamps + ((size_t)blockIdx.x * layers * PHASES + layer * PHASES + p) *
                                           STAMPS;
      if (stamp != nullptr && threadIdx.x == 0) stamp[GT_START] = now_ns();
      stamp_clock(stamp, CLK_START);
      const Phase ph = phase_slice(p, layer, w_qkv, w_o, w_gate_up, w_down);
      const int rows = ph.groups * GROUP_ROWS, t = threadIdx.x;
      if (STREAM_ONLY) {  // wait for the slots, release them, nothing else
        wait_slots(full, seq, ph.slots(), failed);
      } else if (p == 0) {
        const float scale = load_inputs<HIDDEN, true>(residual, staged, warp_sums, full, seq,
                                                      ph.slots(), eps, failed);
        stamp_clock(stamp, CLK_INPUTS);
        row_sums<HIDDEN>(ph, ring, seq, staged, partials, sums);
        if (t < rows) qkv[ph.first_row() + t] = __float2bfloat16(sums[t] * scale);
      } else if (p == 1) {
        load_inputs<Q, false>(qkv, staged, warp_sums, full, seq, ph.slots(), eps, failed);
        stamp_clock(stamp, CLK_INPUTS);
        row_sums<Q>(ph, ring, seq, staged, partials, sums);
        if (t < rows) {
          own = add_rounded(own, sums[t]);
          residual[ph.first_row() + t] = __float2bfloat16(own);
        }
      } else if (p == 2) {
        const float scale = load_inputs<HIDDEN, true>(residual, staged, warp_sums, full, seq,
                                                      ph.slots(), eps, failed);
        stamp_clock(stamp, CLK_INPUTS);
        row_sums<HIDDEN>(ph, ring, seq, staged, partials, sums);
        if (t < rows / 2) {
          const float g = sums[2 * t] * scale, u = sums[2 * t + 1] * scale;
          act[ph.first_row() / 2 + t] = __float2bfloat16(g / (1.f + __expf(-g)) * u);
        }
      } else {
        load_inputs<INTER, false>(act, staged, warp_sums, full, seq, ph.slots(), eps, failed);
        stamp_clock(stamp, CLK_INPUTS);
        row_sums<INTER>(ph, ring, seq, staged, partials, sums);
        if (t < rows) {
          own = add_rounded(own, sums[t]);
          residual[ph.first_row() + t] = __float2bfloat16(own);
        }
      }
      stamp_clock(stamp, CLK_SUMS);
      grid_arrive(arrived);
      release_slots(empty, seq, ph.slots());
      seq += ph.slots();
      stamp_clock(stamp, CLK_ARRIVED);
      if (stamp != nullptr && threadIdx.x == 0) stamp[GT_DONE] = now_ns();
    }
  }
}
