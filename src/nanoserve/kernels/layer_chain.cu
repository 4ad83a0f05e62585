// Batch-1 decode layers of Qwen3-0.6B's shape as one persistent CUDA kernel: the engine's
// batch-1 decode path on sm_90 (layer_chain.py; EngineConfig.persistent_decode). The -D
// switches below are benchmarks/cuda_layer_chain.py's experiments; the engine builds the
// defaults.
//
// The Triton persistent kernel (persistent_layers.py) tied the Triton chain of launches
// because each program could hold only one tile of the next phase's weights, in registers.
// Here one warp per block streams the block's weight slices for every phase of every layer
// into a ring of shared-memory slots with bulk copies (cp.async.bulk, completing on an
// mbarrier), running as far ahead as the ring allows, while the other warps compute. The
// weight stream never waits on the stages; only the small input vectors do.
//
// Per layer, six stages, each waiting on the last one's data (tagged words, or grid barriers):
//   qkv        qkv[r] = (W_qkv'[r] . h) * rsqrt(mean(h^2) + eps)     (norm weight folded in W)
//   attention  q/k RMSNorm and RoPE, the new k/v stored in the paged cache, attention over
//              the cached keys and the new one, in splits (ATTENTION=0 leaves the stage out,
//              and o_proj reads q as qkv wrote it, as split_decode_chain.py's "none" does)
//   merge      the splits merged: attn (MERGE_AS_STAGE=0: merged at the end of attention)
//   o_proj     h[r] = h[r] + bf16(W_o[r] . attn)
//   gate_up    act[f] = silu(g) * u,
//              g/u = (W_gu'[f] / W_gu'[INTER + f] . h) * rsqrt(mean(h^2) + eps)
//   down       h[r] = h[r] + bf16(W_down[r] . act)
// The GEMV stages are "phases" 0-3 below (qkv, o_proj, gate_up, down). VOCAB=1 adds the
// step's ends: the token's embedding row in, the final norm and the LM head's logits out,
// and for a greedy step their argmax (pick_greedy).
// Block b owns rows [b*N/G, (b+1)*N/G) of each phase (features for phase 2: their gate rows
// and their up rows, two copies a slot), so each slice copies as whole rows. Weights, K/V
// caches and the step's position are laid out as the engine holds them: a pointer per layer,
// gate/up as gate's rows then up's, the position in device memory (one graph, every step).
//
// Measured (docs/kernels.md, "Batch-1 layers as one persistent CUDA kernel"): the whole layer
// in 15.1-15.5 µs with tagged data against 16.5-16.9 with grid barriers and 19.5 for the
// Triton chain's forward (runs 227-230, 384 cached keys); in the engine, a decode step in
// 0.514-0.522 ms against 0.626-0.627 with VOCAB=1 (runs 239-242), 0.485-0.491 since the dot
// products issue fewer instructions (runs 251-252: bf16_pair, warp_sum_scatter), and a
// greedy step in 0.474-0.476 with its token picked here, no sampler after (runs 256-257).

#include <cuda_bf16.h>
#ifdef __CUDACC_RTC__  // NVRTC (cuda_build.py) has no C library headers
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
#define INFINITY __int_as_float(0x7f800000)
#else
#include <stdint.h>
#endif

namespace {

constexpr int HIDDEN = 1024;
constexpr int QKV = 4096;
constexpr int Q = 2048;
constexpr int INTER = 3072;
constexpr int PHASES = 4;  // the GEMVs
constexpr int HEADS = 16, KV_HEADS = 8, HEAD_DIM = 128, GROUP = HEADS / KV_HEADS;
// Stages of a layer, in order; stamps are kept per stage.
enum Stage { QKV_STAGE, ATTENTION_STAGE, MERGE_STAGE, O_STAGE, GATE_UP_STAGE, DOWN_STAGE, STAGES };

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
// INFLIGHT > 0 caps the block's copies in flight: the producer waits for the copy issued
// INFLIGHT before to land before it issues the next. Unmetered, the blocks refill their freed
// slots all at once as a phase ends (12.7 MB after gate/up), and the next phase's loads,
// stores and barrier atomics queue behind that burst (run 205, before the slices were
// hoisted: 14.35 µs a layer unmetered, 13.05 at two copies, 13.1 at three or four, 13.2 at one).
// With tagged data and attention, one copy in flight is enough for the stream to keep up and
// leaves the L2 quicker for the handoffs (runs 227-228: 15.12-15.32 µs a layer against
// 15.54-15.73 at two); without attention the stream then falls behind (13.3-13.5 against
// 11.0-11.7).
#ifndef INFLIGHT
#define INFLIGHT 1
#endif
// Timing aids, each making the results wrong: STREAM_ONLY leaves the consumers nothing but
// waiting for each slot and releasing it (the weight stream's own pace), NO_WEIGHTS skips the
// weight stream (the barriers' and vectors' pace), NO_DOTS also skips the dot products (each
// output is an input value, still summed across the warp), and BARRIER_ONLY (with
// NO_WEIGHTS) leaves nothing between the grid barriers.
#ifndef STREAM_ONLY
#define STREAM_ONLY 0
#endif
#ifndef NO_WEIGHTS
#define NO_WEIGHTS 0
#endif
#ifndef NO_DOTS
#define NO_DOTS 0
#endif
#ifndef BARRIER_ONLY
#define BARRIER_ONLY 0
#endif
#ifndef ATTENTION
#define ATTENTION 1
#endif
// Attention work items: (KV head, split) pairs, one per block. A warp holds at most
// KEYS_PER_WARP of its split's keys, so a split is at most CONSUMER_WARPS * KEYS_PER_WARP keys.
#ifndef SPLITS
#define SPLITS 16
#endif
// MERGE_AS_STAGE merges the attention splits in a stage of their own, every block a few
// outputs; otherwise the last block of each KV head to finish merges its splits, counted
// with an atomic (run 214: 17.69 µs a layer against 16.97 as a stage).
#ifndef MERGE_AS_STAGE
#define MERGE_AS_STAGE 1
#endif
// TAGGED=1 (the default) hands data from stage to stage without grid barriers: every value a
// stage hands on carries its layer's tag in the same single-copy-atomic word (a bf16 value and
// a 16-bit tag in 32 bits; a float partial and its tag in 64), and a reader polls the words it
// needs until all carry the tag it expects, so the data are their own flags (as in NCCL's
// low-latency protocol): no fence, no counter. TAGGED=0 meets at grid barriers instead.
// Runs 217-229: 0.45-1.3 µs a layer less than the barriers (run 229: 15.33 against 16.65).
#ifndef TAGGED
#define TAGGED 1
#endif
// Nanoseconds a tagged poll sleeps between looks. Spinning (0) was slower (run 217: 17.0 µs a
// layer against 15.75 at 256): 132 blocks re-reading the same lines slow the L2 for everyone.
// The barrier's single poller is better off spinning (run 218), so it never sleeps.
#ifndef POLL_NS
#define POLL_NS 256
#endif
// VOCAB=1 (the engine's build) runs the whole step between the token and its logits: the
// kernel reads the token's embedding row itself, and after the last layer it goes on to the
// final RMSNorm and the LM head's GEMV over the vocabulary, whose weights the stream starts
// on while the last layer still computes, written as bf16 logits. VOCAB=0 runs the layers
// from a residual row in memory to the residual after the last layer.
#ifndef VOCAB
#define VOCAB 0
#endif
// Bulk copies of the LM head a block keeps in flight: it is the one phase that streams at the
// memory's pace rather than the handoffs', so it needs many (0: as many as the ring holds).
#ifndef HEAD_INFLIGHT
#define HEAD_INFLIGHT 0
#endif
#if BARRIER_ONLY && !NO_WEIGHTS
#error "BARRIER_ONLY needs NO_WEIGHTS=1: nothing would release the weight slots"
#endif
#if TAGGED && (BARRIER_ONLY || !MERGE_AS_STAGE)
#error "TAGGED needs the data a barrier would order: no BARRIER_ONLY, the merge as a stage"
#endif
constexpr int CONSUMERS = CONSUMER_WARPS * 32;
constexpr int THREADS = CONSUMERS + 32;  // the last warp streams the weights
// Polls before a wait gives up and flags the launch, so a bug fails the check instead of
// hanging the device; once flagged, every wait gives up at its next look at the flag.
constexpr uint32_t SPIN_LIMIT = 1u << 22;
constexpr uint32_t FLAG_EVERY = 1024;

// The fewest blocks the launch may have: it bounds the rows (phase 2: features) a warp owns
// in a phase, which its registers hold.
constexpr int MIN_GRID = 128;
__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int units_per_warp(int n) {
  return ceil_div(ceil_div(n, MIN_GRID), CONSUMER_WARPS);
}
constexpr int OWN_ROWS = units_per_warp(HIDDEN);  // residual rows a warp updates
#ifndef KEYS_PER_WARP
#define KEYS_PER_WARP 4
#endif
constexpr int PARTIAL = HEAD_DIM + 2;  // a split's (max, sum, output) for one q head
static_assert(KV_HEADS * SPLITS <= MIN_GRID, "one block per (KV head, split)");
static_assert(SPLITS <= 32 && (SPLITS & (SPLITS - 1)) == 0, "a split per lane, in groups");
static_assert(ceil_div(HEADS * HEAD_DIM, MIN_GRID) * SPLITS <= CONSUMERS,
              "the merge gives each of a block's outputs SPLITS threads");

// The step's attention inputs; the caches and norm weights hold every layer.
// In the engine's layout: a cache tensor per layer, the step's position in device memory (so
// one CUDA graph serves every step), RoPE's table for all positions.
struct AttentionArgs {
  __nv_bfloat16* const* k_caches;  // per layer: [cache blocks, block_size, KV_HEADS, HEAD_DIM]
  __nv_bfloat16* const* v_caches;
  const int* block_table;   // the sequence's cache blocks
  const int64_t* position;  // the new token's position: the cached keys before it
  int context;              // *position, read by the kernel as it starts
  int block_size;
  const float* cos_sin;     // [positions, HEAD_DIM]: cos, then sin, of each position's angles
  const float* q_norm;      // [layers, HEAD_DIM]
  const float* k_norm;
  float* partials;          // [HEADS, SPLITS, PARTIAL]
  unsigned int* head_done;  // [KV_HEADS] splits finished, zero at launch
  __nv_bfloat16* out;       // [HEADS * HEAD_DIM]
};

// TAGGED's exchange buffers, in tagged words; each is written once per layer.
struct TaggedArgs {
  uint32_t* qkv;           // [QKV]
  uint64_t* partials;      // [HEADS, SPLITS, PARTIAL]
  uint32_t* attn;          // [Q]
  uint32_t* residual_o;    // [HIDDEN], o_proj's
  uint32_t* act;           // [INTER]
  uint32_t* residual_down; // [HIDDEN], down's
  unsigned int* epoch;     // launches so far: tags differ from the previous launch's
};

// VOCAB's operands: the step's token and the embedding it reads, the final norm and the LM
// head, and where their results go.
struct Vocab {
  const int64_t* token_index;    // where in `tokens` the step's token id is
  const int64_t* tokens;
  const __nv_bfloat16* embed;    // [size, HIDDEN]
  const __nv_bfloat16* head;     // [size, HIDDEN] (the embedding, where tied)
  const float* norm;             // [HIDDEN], the final RMSNorm's weight
  __nv_bfloat16* normed;         // [HIDDEN]: the final hidden state (block 0 writes it)
  __nv_bfloat16* logits;         // [size]
  // The greedy pick (pick_greedy): its two counters, zero at launch and left so, and where
  // the token goes; no pick where `greedy_token` is null. `host_token` (may be null) holds
  // the address of pinned host memory the token is also written to, or 0: the step's copy
  // of its token to the host then needs no operation of its own.
  unsigned long long* greedy_state;  // [2]: the best rank so far, the blocks done
  int64_t* greedy_token;
  const uint64_t* host_token;
  int size;
};

// A stage's output: plain bf16 (the barrier build; TAGGED, where not null, the final
// residual) and, TAGGED, tagged words.
struct Out {
  __nv_bfloat16* plain;
  uint32_t* tagged;
  uint32_t tag;
};

__device__ __forceinline__ void store_relaxed(uint32_t* p, uint32_t word) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(word) : "memory");
}

__device__ __forceinline__ void store_relaxed(uint64_t* p, uint64_t word) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(word) : "memory");
}

__device__ __forceinline__ uint4 load_relaxed(const uint32_t* p) {
  uint4 w;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
               : "l"(p)
               : "memory");
  return w;
}

__device__ __forceinline__ uint64_t load_relaxed(const uint64_t* p) {
  uint64_t w;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
  return w;
}

__device__ __forceinline__ void put(const Out& out, int i, float value) {
  const __nv_bfloat16 b = __float2bfloat16(value);
  if (TAGGED)
    store_relaxed(out.tagged + i, (out.tag << 16) | *reinterpret_cast<const uint16_t*>(&b));
  if (!TAGGED || out.plain != nullptr) out.plain[i] = b;
}

__device__ __forceinline__ bool has_tag(uint4 w, uint32_t tag) {
  return (w.x >> 16) == tag && (w.y >> 16) == tag && (w.z >> 16) == tag && (w.w >> 16) == tag;
}

// Four tagged words' values as four bf16, as uint2 holds them in the plain buffers.
__device__ __forceinline__ uint2 untag(uint4 w) {
  return {(w.x & 0xffffu) | (w.y << 16), (w.z & 0xffffu) | (w.w << 16)};
}

// Polls until ready(i) holds for each of a thread's N pieces, fetching again (reload(i)) only
// the pieces not yet ready. Gives up as the barrier waits do.
template <int N, typename Ready, typename Reload>
__device__ __forceinline__ void poll(Ready ready, Reload reload, int* failed) {
  for (uint32_t spins = 0;; ++spins) {
    bool all = true;
#pragma unroll
    for (int i = 0; i < N; ++i) all = all && ready(i);
    if (all) return;
    if (spins == SPIN_LIMIT) atomicExch(failed, 1);
    if (spins % FLAG_EVERY == FLAG_EVERY - 1 && *(volatile int*)failed) return;
    if (POLL_NS > 0) __nanosleep(POLL_NS);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (!ready(i)) reload(i);
    }
  }
}

// Each layer's weights, as the engine holds them: a pointer per layer and matrix, row-major,
// gate/up as gate's INTER rows then up's.
struct Weights {
  const __nv_bfloat16* const* qkv;  // [layers] -> [QKV, HIDDEN]
  const __nv_bfloat16* const* o;    // [layers] -> [HIDDEN, Q]
  const __nv_bfloat16* const* gate_up;  // [layers] -> [2 * INTER, HIDDEN]
  const __nv_bfloat16* const* down;     // [layers] -> [HIDDEN, INTER]
};

__device__ __forceinline__ const __nv_bfloat16* phase_weight(const Weights& w, int phase,
                                                             int layer) {
  const __nv_bfloat16* const* per_layer =
      phase == 0 ? w.qkv : phase == 1 ? w.o : phase == 2 ? w.gate_up : w.down;
  return per_layer[layer];
}

// The block's slice of a phase: rows [first_row, end_row) of its weight, each k long (phase 2
// counts two rows per feature f, its gate row f and its up row INTER + f).
struct Phase {
  int first_row;
  int end_row;
  int k;
};

__device__ __forceinline__ Phase phase_slice(int phase) {
  const int b = blockIdx.x, g = gridDim.x;
  switch (phase) {
    case 0: return {b * QKV / g, (b + 1) * QKV / g, HIDDEN};
    case 1: return {b * HIDDEN / g, (b + 1) * HIDDEN / g, Q};
    case 2: return {2 * (b * INTER / g), 2 * ((b + 1) * INTER / g), HIDDEN};
    default: return {b * HIDDEN / g, (b + 1) * HIDDEN / g, INTER};
  }
}

__host__ __device__ constexpr int rows_per_slot(int k) { return SLOT_BYTES / (k * 2); }

// The tag a layer's handoffs carry in launch `epoch`: never 0, which fresh buffers hold, and
// never the previous layer's or launch's.
__device__ __forceinline__ uint32_t layer_tag(unsigned int epoch, int layers, int layer) {
  return (epoch * layers + layer) % 65535u + 1u;
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

// The producer's next slot for copy `seq`: waits for the slot's previous use to be handed
// back and, where `inflight` > 0, for the copy `inflight` before to land (the meter).
__device__ __forceinline__ int claim_slot(uint32_t seq, int inflight, uint64_t* full,
                                          uint64_t* empty, int* failed) {
  const int slot = seq % SLOTS;
  if (seq >= SLOTS) mbarrier_wait(&empty[slot], (seq / SLOTS - 1) & 1, failed);
  if (inflight > 0 && seq >= (uint32_t)inflight) {
    const uint32_t landed = seq - inflight;
    mbarrier_wait(&full[landed % SLOTS], (landed / SLOTS) & 1, failed);
  }
  return slot;
}

__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");
}

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Grid barrier on a counter that only grows (TAGGED=0): the n-th barrier of a launch waits for
// n * grid arrivals. Called by every consumer thread; thread 0 does the global part. The
// release add publishes the block's stores (ordered before it by bar.sync), the acquire poll
// makes the other blocks' visible to the block (ordered after it by bar.sync); no separate
// fences. With TAGGED=1 a stage ends with the consumers' bar.sync alone (the slots it frees and
// the shared input vector are then done with).
__device__ __forceinline__ void grid_arrive(unsigned int* arrived) {
  consumers_sync();
  if (threadIdx.x == 0 && !STREAM_ONLY && !TAGGED)
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(arrived) : "memory");
}

// Hands slots [seq, seq + slots) back to the producer, lane 0 of warp i the i-th; called
// after a barrier among the consumers that follows their last read of the slots.
__device__ __forceinline__ void release_slots(uint64_t* empty, uint32_t seq, int slots) {
  if (threadIdx.x % 32 == 0 && !NO_WEIGHTS) {
    for (int i = threadIdx.x / 32; i < slots; i += CONSUMER_WARPS)
      mbarrier_arrive(&empty[(seq + i) % SLOTS]);
  }
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

// Per block, stage and layer: globaltimer as the stage starts (the barrier passed, or TAGGED,
// the stage before done), then SM clocks as it starts, as the inputs are in (slots and vector,
// or attention's q, k, v, or the merge's partials), as the outputs are stored, as the block has
// arrived (TAGGED: passed the consumers' sync); and globaltimer again then.
enum Stamp { GT_START, CLK_START, CLK_INPUTS, CLK_SUMS, CLK_ARRIVED, GT_DONE, STAMPS };

__device__ __forceinline__ void stamp_clock(uint64_t* stamp, int which) {
  if (stamp != nullptr && threadIdx.x == 0) stamp[which] = clock64();
}

// A word's two bf16 values (the first in the low half) as floats, exactly: a bf16 is a float's
// high 16 bits. One integer op each, where __bfloat1622float2 spends three on the pair (the
// high value extracted, then shifted): the dot products issue ~20% fewer instructions, and
// they are issue-bound (run 250's warp samples: 39% issuing, 18% not selected).
__device__ __forceinline__ float2 bf16_pair(uint32_t word) {
  return {__uint_as_float(word << 16), __uint_as_float(word & 0xffff0000u)};
}

// The phase's inputs. Its weight slots: thread i waits for the phase's i-th slot, so the
// waits overlap (a warp waiting on each of its slots in turn cost ~0.1 µs per wait, run 202),
// and the barrier after makes the copies visible to every consumer. Its input vector: read
// from L2 once per block into shared memory (every warp of every block reading it makes its
// few lines a hot spot: ~1 µs, run 200), then each lane's share into registers: 16-byte pieces
// (j * 32 + lane) * 8, so that a warp reads 512 contiguous bytes per step, as from a weight row.
// The vector is plain bf16 `v`, or, where `tagged` is not null, tagged words polled for `tag`.
template <int K>
__device__ __forceinline__ void load_inputs(const __nv_bfloat16* v, const uint32_t* tagged,
                                            uint32_t tag, uint4* staged, uint64_t* full,
                                            uint32_t seq, int slots, int lane, float (&x)[K / 32],
                                            int* failed) {
  constexpr int PLAIN = ceil_div(K / 8, CONSUMERS), TAGS = ceil_div(K / 4, CONSUMERS);
  uint4 pieces[TAGS > PLAIN ? TAGS : PLAIN];
  if (tagged == nullptr) {
#pragma unroll
    for (int i = 0; i < PLAIN; ++i) {
      const int index = threadIdx.x + i * CONSUMERS;
      if (index < K / 8) pieces[i] = __ldcg(reinterpret_cast<const uint4*>(v) + index);
    }
  } else {
#pragma unroll
    for (int i = 0; i < TAGS; ++i) {
      const int index = threadIdx.x + i * CONSUMERS;
      if (index < K / 4) pieces[i] = load_relaxed(tagged + 4 * index);
    }
  }
  if (!NO_WEIGHTS && (int)threadIdx.x < slots) {
    const uint32_t s = seq + threadIdx.x;
    mbarrier_wait(&full[s % SLOTS], (s / SLOTS) & 1, failed);
  }
  if (tagged == nullptr) {
#pragma unroll
    for (int i = 0; i < PLAIN; ++i) {
      const int index = threadIdx.x + i * CONSUMERS;
      if (index < K / 8) staged[index] = pieces[i];
    }
  } else {
    auto index = [&](int i) { return (int)threadIdx.x + i * CONSUMERS; };
    poll<TAGS>([&](int i) { return index(i) >= K / 4 || has_tag(pieces[i], tag); },
               [&](int i) {
                 if (index(i) < K / 4) pieces[i] = load_relaxed(tagged + 4 * index(i));
               },
               failed);
#pragma unroll
    for (int i = 0; i < TAGS; ++i) {
      if (index(i) < K / 4) reinterpret_cast<uint2*>(staged)[index(i)] = untag(pieces[i]);
    }
  }
  consumers_sync();
#pragma unroll
  for (int j = 0; j < K / 256; ++j) {
    const uint4 piece = staged[j * 32 + lane];
    const uint32_t words[4] = {piece.x, piece.y, piece.z, piece.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = bf16_pair(words[e]);
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
    const uint4 piece = reinterpret_cast<const uint4*>(row)[j * 32 + lane];
    const uint32_t words[4] = {piece.x, piece.y, piece.z, piece.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 w = bf16_pair(words[e]);
      acc[2 * e] = fmaf(w.x, x[j * 8 + 2 * e], acc[2 * e]);
      acc[2 * e + 1] = fmaf(w.y, x[j * 8 + 2 * e + 1], acc[2 * e + 1]);
    }
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

__host__ __device__ constexpr int log2_of(int n) { return n <= 1 ? 0 : 1 + log2_of(n / 2); }
__host__ __device__ constexpr int pow2_at_least(int n) {
  return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2);
}

// Warp sums of N values (N / KEEP a power of two) as a reduce-scatter butterfly: at each of the
// first log2(N / KEEP) steps a lane sends half of the values it still holds and keeps the other
// half, so a step shuffles half as many as the one before, then KEEP values go through the
// remaining steps whole. Lane l ends with the sums of values [KEEP * g, KEEP * g + KEEP) in
// v[0, KEEP), g being l's top log2(N / KEEP) bits, bit 4 first; the lanes that share a g hold
// the same sums, and the first of them is the one to store them: it gets g back, the others
// -1. KEEP = N is the plain butterfly, lane 0 storing. For N = 4 that is 6 shuffles where the
// plain one takes 20, and 12 against 30 (gate/up, padded to 8) or 9 against 40 (the LM head's
// 8): the kernel alone 487 µs against 497-503 (run 251).
template <int N, int KEEP>
__device__ __forceinline__ int warp_sum_scatter(float (&v)[N], int lane) {
  constexpr int STEPS = log2_of(N / KEEP);
  static_assert(KEEP << STEPS == N && STEPS <= 5, "N / KEEP a power of two, at most 32");
  int group = 0;
#pragma unroll
  for (int step = 0; step < STEPS; ++step) {
    const int offset = 16 >> step, half = N >> (step + 1);
    const bool upper = (lane & offset) != 0;
    group = 2 * group + upper;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float send = upper ? v[i] : v[i + half], keep = upper ? v[i + half] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
    }
  }
#pragma unroll
  for (int offset = 16 >> STEPS; offset > 0; offset >>= 1) {
#pragma unroll
    for (int i = 0; i < KEEP; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], offset);
  }
  return lane % (32 >> STEPS) == 0 ? group : -1;
}

template <int K>
__device__ __forceinline__ float rms_scale(const float (&x)[K / 32], float eps) {
  float part[4] = {};  // independent chains, so the FMAs overlap
#pragma unroll
  for (int i = 0; i < K / 32; ++i) part[i % 4] = fmaf(x[i], x[i], part[i % 4]);
  float ss = (part[0] + part[1]) + (part[2] + part[3]);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, offset);
  return rsqrtf(ss / K + eps);
}

__device__ __forceinline__ float add_rounded(float h, float product) {
  // As F.linear(...) + residual rounds: the product to bf16 first, then the sum.
  return __bfloat162float(
      __float2bfloat16(h + __bfloat162float(__float2bfloat16(product))));
}

// One phase's dot products, its slots all in. Warp w owns the slice's units (rows; phase 2:
// gate/up row pairs) w, w + CONSUMER_WARPS, ... and sums their dot products in one butterfly,
// phases 0 and 2 scattering the units' sums over its lanes (padded to a power of two), each
// unit's lane storing it. Phases 1 and 3 add into the block's residual rows, which the warp
// keeps in `own` (lane 0) across phases and layers.
template <int K, int PHASE, int UNITS>
__device__ __forceinline__ void consume_phase(const Phase& ph, const float (&x)[K / 32],
                                              float scale, const uint8_t* ring, uint32_t seq,
                                              const Out& out, float (&own)[OWN_ROWS]) {
  constexpr int PER_SLOT = SLOT_BYTES / (K * 2);
  constexpr int UNIT_ROWS = PHASE == 2 ? 2 : 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int units = (ph.end_row - ph.first_row) / UNIT_ROWS;
  constexpr bool SCATTER = PHASE % 2 == 0;
  constexpr int SUMS = (SCATTER ? pow2_at_least(UNITS) : UNITS) * UNIT_ROWS;
  constexpr int KEEP = SCATTER ? UNIT_ROWS : SUMS;
  float sums[SUMS];
#pragma unroll
  for (int i = UNITS * UNIT_ROWS; i < SUMS; ++i) sums[i] = 0.f;
#pragma unroll
  for (int t = 0; t < UNITS; ++t) {
    const int unit = warp + t * CONSUMER_WARPS;
    // A slot holds PER_SLOT / UNIT_ROWS units; phase 2's gate rows fill its first half and
    // their up rows the second.
    const int slot_index = unit * UNIT_ROWS / PER_SLOT;
    const int within = unit - slot_index * (PER_SLOT / UNIT_ROWS);
    const uint8_t* row = ring + ((seq + slot_index) % SLOTS) * SLOT_BYTES + within * K * 2;
#pragma unroll
    for (int r = 0; r < UNIT_ROWS; ++r) {
      const uint8_t* weights = row + r * (PER_SLOT / 2) * K * 2;
      sums[t * UNIT_ROWS + r] =
          unit >= units ? 0.f : NO_DOTS ? x[r] : lane_dot<K>(weights, lane, x);
    }
  }
  const int stored = warp_sum_scatter<SUMS, KEEP>(sums, lane);
  if (stored < 0) return;
  if constexpr (SCATTER) {
    const int t = stored, unit = warp + t * CONSUMER_WARPS;
    if (t >= UNITS || unit >= units) return;
    if (PHASE == 0) {
      put(out, ph.first_row + unit, sums[0] * scale);
    } else {
      const float g = sums[0] * scale, u = sums[1] * scale;
      put(out, ph.first_row / 2 + unit, g / (1.f + __expf(-g)) * u);
    }
  } else {  // phases 1 and 3: lane 0 holds every sum
#pragma unroll
    for (int t = 0; t < UNITS; ++t) {
      const int unit = warp + t * CONSUMER_WARPS;
      if (unit >= units) continue;
      own[t] = add_rounded(own[t], sums[t]);
      put(out, ph.first_row + unit, own[t]);
    }
  }
}

// The block's attention work item and its keys: split s of KV head h, keys [first, end) of
// the context's cached keys and the new token's (position context, in the last split).
struct KeyRange {
  int head, split, first, end;
};

__device__ __forceinline__ KeyRange key_range(const AttentionArgs& a) {
  const int b = blockIdx.x, n = a.context + 1;
  const int split = b % SPLITS;
  return {b / SPLITS, split, split * n / SPLITS, (split + 1) * n / SPLITS};
}

// A position's key (or value) for KV head `head`, within a layer's cache.
__device__ __forceinline__ size_t cache_offset(const AttentionArgs& a, int position, int head) {
  const int block = a.block_table[position / a.block_size];
  return ((size_t)block * a.block_size + position % a.block_size) * KV_HEADS * HEAD_DIM +
         head * HEAD_DIM;
}

// What a block's attention reads that does not depend on this step, read before it waits for
// q, k and v: the warp's cached keys and values (lane l holding dimensions [4l, 4l + 4) of
// each, as bf16 pairs), the lane's q/k norm weights, cos and sin, and where the new key goes.
// Read after the wait, these cost an L2 round trip on the critical path (run 227).
struct Prefetched {
  uint2 k[KEYS_PER_WARP], v[KEYS_PER_WARP];
  float q_norm[4], k_norm[4], cos[4], sin[4];
  size_t new_kv;
};

__device__ __forceinline__ void prefetch_attention(const AttentionArgs& a, int layer,
                                                   Prefetched& f) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (blockIdx.x >= KV_HEADS * SPLITS) return;
  const KeyRange r = key_range(a);
#pragma unroll
  for (int t = 0; t < KEYS_PER_WARP; ++t) {
    const int j = r.first + warp + t * CONSUMER_WARPS;
    if (j < min(r.end, a.context)) {
      const size_t offset = cache_offset(a, j, r.head) + 4 * lane;
      f.k[t] = *reinterpret_cast<const uint2*>(a.k_caches[layer] + offset);
      f.v[t] = *reinterpret_cast<const uint2*>(a.v_caches[layer] + offset);
    }
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int d = 4 * lane + e, i = d % (HEAD_DIM / 2);
    f.q_norm[e] = a.q_norm[layer * HEAD_DIM + d];
    f.k_norm[e] = a.k_norm[layer * HEAD_DIM + d];
    f.cos[e] = a.cos_sin[i];
    f.sin[e] = a.cos_sin[HEAD_DIM / 2 + i];
  }
  if (r.end == a.context + 1 && warp == 0)
    f.new_kv = cache_offset(a, a.context, r.head) + 4 * lane;
}

__device__ __forceinline__ void unpack4(uint2 w, float (&x)[4]) {
  const float2 lo = bf16_pair(w.x), hi = bf16_pair(w.y);
  x[0] = lo.x, x[1] = lo.y, x[2] = hi.x, x[3] = hi.y;
}

__device__ __forceinline__ uint2 pack4(const float (&x)[4]) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(x[0], x[1]);
  const __nv_bfloat162 hi = __floats2bfloat162_rn(x[2], x[3]);
  return {*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi)};
}

// RMSNorm over the head (every lane holds 4 of its 128 values), the norm weight, neox RoPE
// (dimension d pairs with d ± 64, held by lane ± 16), then rounded to bf16 as stored.
__device__ __forceinline__ void norm_rope(float (&x)[4], const float (&weight)[4],
                                          const Prefetched& f, float eps) {
  const int lane = threadIdx.x % 32;
  float ss = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) ss = fmaf(x[e], x[e], ss);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, offset);
  const float r = rsqrtf(ss / HEAD_DIM + eps);
#pragma unroll
  for (int e = 0; e < 4; ++e) x[e] *= r * weight[e];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float partner = __shfl_xor_sync(0xffffffffu, x[e], 16);
    x[e] = lane < 16 ? x[e] * f.cos[e] - partner * f.sin[e] : x[e] * f.cos[e] + partner * f.sin[e];
  }
  float rounded[4];
  unpack4(pack4(x), rounded);
#pragma unroll
  for (int e = 0; e < 4; ++e) x[e] = rounded[e];
}

// A split's partial value: plain float, or TAGGED, the float and its tag in one 64-bit word.
__device__ __forceinline__ void put_partial(const AttentionArgs& a, uint64_t* tagged, size_t i,
                                            float value, uint32_t tag) {
  if (TAGGED)
    store_relaxed(tagged + i, (uint64_t)tag << 32 | __float_as_uint(value));
  else
    a.partials[i] = value;
}

// Attention for the block's (KV head, split): its GROUP q heads' partial softmax over the
// split's keys into `partials`; the last block of a KV head to finish merges its splits.
// TAGGED, q, k and v come from tagged words and the partials go out as tagged words.
__device__ __forceinline__ void attention_stage(const AttentionArgs& a, int layer,
                                                const __nv_bfloat16* qkv,
                                                const TaggedArgs& tagged, uint32_t tag,
                                                const Prefetched& f, float eps, float* scratch,
                                                uint2* shared_bits, int* last, uint64_t* stamp,
                                                int* failed) {
  if (blockIdx.x >= KV_HEADS * SPLITS) {
    stamp_clock(stamp, CLK_INPUTS);
    return;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const KeyRange r = key_range(a);
  if (r.end - r.first > CONSUMER_WARPS * KEYS_PER_WARP && threadIdx.x == 0)
    atomicExch(failed, 1);  // keys past the warps' registers would be left out
  // The lane's 4 values of each q head of the group, then of k, then of v.
  auto offset = [&](int i) {
    const int head = i < GROUP    ? r.head * GROUP + i
                     : i == GROUP ? HEADS + r.head
                                  : HEADS + KV_HEADS + r.head;
    return head * HEAD_DIM + 4 * lane;
  };
  uint2 bits[GROUP + 2];
  if (TAGGED) {  // warp 0 polls, the others read what it found from shared memory
    if (warp == 0) {
      uint4 words[GROUP + 2];
#pragma unroll
      for (int i = 0; i < GROUP + 2; ++i) words[i] = load_relaxed(tagged.qkv + offset(i));
      poll<GROUP + 2>([&](int i) { return has_tag(words[i], tag); },
                      [&](int i) { words[i] = load_relaxed(tagged.qkv + offset(i)); }, failed);
#pragma unroll
      for (int i = 0; i < GROUP + 2; ++i) shared_bits[i * 32 + lane] = untag(words[i]);
    }
    consumers_sync();
#pragma unroll
    for (int i = 0; i < GROUP + 2; ++i) bits[i] = shared_bits[i * 32 + lane];
  } else {
#pragma unroll
    for (int i = 0; i < GROUP + 2; ++i)
      bits[i] = __ldcg(reinterpret_cast<const uint2*>(qkv + offset(i)));
  }
  stamp_clock(stamp, CLK_INPUTS);
  float q[GROUP][4], k_new[4], v_new[4];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) unpack4(bits[g], q[g]);
  unpack4(bits[GROUP], k_new);
  const uint2 v_bits = bits[GROUP + 1];
  unpack4(v_bits, v_new);
#pragma unroll
  for (int g = 0; g < GROUP; ++g) norm_rope(q[g], f.q_norm, f, eps);
  norm_rope(k_new, f.k_norm, f, eps);
  if (r.end == a.context + 1 && warp == 0) {
    *reinterpret_cast<uint2*>(a.k_caches[layer] + f.new_kv) = pack4(k_new);
    *reinterpret_cast<uint2*>(a.v_caches[layer] + f.new_kv) = v_bits;
  }
  // Scores of the warp's keys for each q head, summed across the warp together.
  float scores[KEYS_PER_WARP][GROUP];
  float keys[KEYS_PER_WARP][4], values[KEYS_PER_WARP][4];
#pragma unroll
  for (int t = 0; t < KEYS_PER_WARP; ++t) {
    const bool is_new = r.first + warp + t * CONSUMER_WARPS == a.context;
    unpack4(f.k[t], keys[t]);
    unpack4(f.v[t], values[t]);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      keys[t][e] = is_new ? k_new[e] : keys[t][e];
      values[t][e] = is_new ? v_new[e] : values[t][e];
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) dot = fmaf(q[g][e], keys[t][e], dot);
      scores[t][g] = dot;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
    for (int t = 0; t < KEYS_PER_WARP; ++t) {
#pragma unroll
      for (int g = 0; g < GROUP; ++g)
        scores[t][g] += __shfl_xor_sync(0xffffffffu, scores[t][g], offset);
    }
  }
  // The warp's softmax pieces in base 2, then the block's, through shared memory.
  const float scale = rsqrtf((float)HEAD_DIM) * 1.4426950408889634f;
  float* warp_max = scratch;                                  // [CONSUMER_WARPS][GROUP]
  float* warp_sum = scratch + CONSUMER_WARPS * GROUP;         // [CONSUMER_WARPS][GROUP]
  float* warp_acc = scratch + 2 * CONSUMER_WARPS * GROUP;     // [CONSUMER_WARPS][GROUP][HEAD_DIM]
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    float m = -INFINITY;
#pragma unroll
    for (int t = 0; t < KEYS_PER_WARP; ++t) {
      if (r.first + warp + t * CONSUMER_WARPS < r.end) m = fmaxf(m, scores[t][g] * scale);
    }
    float sum = 0.f, acc[4] = {};
#pragma unroll
    for (int t = 0; t < KEYS_PER_WARP; ++t) {
      if (r.first + warp + t * CONSUMER_WARPS >= r.end) continue;
      const float prob = exp2f(scores[t][g] * scale - m);
      sum += prob;
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] = fmaf(prob, values[t][e], acc[e]);
    }
    if (lane == 0) warp_max[warp * GROUP + g] = m, warp_sum[warp * GROUP + g] = sum;
#pragma unroll
    for (int e = 0; e < 4; ++e) warp_acc[(warp * GROUP + g) * HEAD_DIM + 4 * lane + e] = acc[e];
  }
  consumers_sync();
  if (warp < GROUP) {
    const int g = warp, head = r.head * GROUP + g;
    float m = -INFINITY;
    for (int w = 0; w < CONSUMER_WARPS; ++w) m = fmaxf(m, warp_max[w * GROUP + g]);
    float sum = 0.f, acc[4] = {};
    for (int w = 0; w < CONSUMER_WARPS; ++w) {
      const float f = m == -INFINITY ? 0.f : exp2f(warp_max[w * GROUP + g] - m);
      sum = fmaf(warp_sum[w * GROUP + g], f, sum);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc[e] = fmaf(warp_acc[(w * GROUP + g) * HEAD_DIM + 4 * lane + e], f, acc[e]);
    }
    const size_t partial = ((size_t)head * SPLITS + r.split) * PARTIAL;
    if (lane == 0) {
      put_partial(a, tagged.partials, partial, m, tag);
      put_partial(a, tagged.partials, partial + 1, sum, tag);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e)
      put_partial(a, tagged.partials, partial + 2 + 4 * lane + e, acc[e], tag);
  }
  if (MERGE_AS_STAGE) return;
  consumers_sync();
  if (threadIdx.x == 0) {
    __threadfence();
    *last = atomicAdd(&a.head_done[r.head], 1u) == SPLITS - 1;
  }
  consumers_sync();
  if (!*last || warp >= GROUP) return;
  // The last split of this KV head to finish: merge each q head's splits into attn.
  __threadfence();
  const int head = r.head * GROUP + warp;
  const float* partial = a.partials + (size_t)head * SPLITS * PARTIAL;
  const float my_max = lane < SPLITS ? __ldcg(partial + lane * PARTIAL) : -INFINITY;
  float m = my_max;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  float sum = 0.f, acc[4] = {};
  for (int split = 0; split < SPLITS; ++split) {
    const float split_max = __shfl_sync(0xffffffffu, my_max, split);
    const float f = split_max == -INFINITY ? 0.f : exp2f(split_max - m);
    sum = fmaf(__ldcg(partial + split * PARTIAL + 1), f, sum);
#pragma unroll
    for (int e = 0; e < 4; ++e)
      acc[e] = fmaf(__ldcg(partial + split * PARTIAL + 2 + 4 * lane + e), f, acc[e]);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) acc[e] /= sum;
  *reinterpret_cast<uint2*>(a.out + head * HEAD_DIM + 4 * lane) = pack4(acc);
  if (warp == 0 && lane == 0) a.head_done[r.head] = 0;  // for the next layer
}

// The merge stage: block b merges attn outputs [b * n / G, (b + 1) * n / G), SPLITS
// neighbouring threads each, a split's partial per thread (TAGGED: polled from tagged words),
// combined by shuffles.
__device__ __forceinline__ void merge_stage(const AttentionArgs& a, const TaggedArgs& tagged,
                                            uint32_t tag, uint64_t* stamp, int* failed) {
  constexpr int OUTPUTS = HEADS * HEAD_DIM;
  const int first = blockIdx.x * OUTPUTS / gridDim.x;
  const int output = first + threadIdx.x / SPLITS, split = threadIdx.x % SPLITS;
  const bool mine = output < (blockIdx.x + 1) * OUTPUTS / gridDim.x;
  const size_t partial = ((size_t)(output / HEAD_DIM) * SPLITS + split) * PARTIAL;
  const size_t index[3] = {partial, partial + 1, partial + 2 + output % HEAD_DIM};
  float max = -INFINITY, sum = 0.f, out = 0.f;
  if (mine && TAGGED) {
    uint64_t words[3];
#pragma unroll
    for (int i = 0; i < 3; ++i) words[i] = load_relaxed(tagged.partials + index[i]);
    poll<3>([&](int i) { return (uint32_t)(words[i] >> 32) == tag; },
            [&](int i) { words[i] = load_relaxed(tagged.partials + index[i]); }, failed);
    max = __uint_as_float((uint32_t)words[0]);
    sum = __uint_as_float((uint32_t)words[1]);
    out = __uint_as_float((uint32_t)words[2]);
  } else if (mine) {
    max = __ldcg(a.partials + index[0]);
    sum = __ldcg(a.partials + index[1]);
    out = __ldcg(a.partials + index[2]);
  }
  stamp_clock(stamp, CLK_INPUTS);
  float m = max;
#pragma unroll
  for (int offset = SPLITS / 2; offset > 0; offset >>= 1)
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  const float f = max == -INFINITY ? 0.f : exp2f(max - m);
  sum *= f;
  out *= f;
#pragma unroll
  for (int offset = SPLITS / 2; offset > 0; offset >>= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    out += __shfl_xor_sync(0xffffffffu, out, offset);
  }
  if (mine && split == 0) put(Out{TAGGED ? nullptr : a.out, tagged.attn, tag}, output, out / sum);
}

// The block's rows of the LM head.
__device__ __forceinline__ Phase head_slice(int size) {
  const int b = blockIdx.x, g = gridDim.x;
  return {(int)((long long)b * size / g), (int)((long long)(b + 1) * size / g), HIDDEN};
}

// A logit's rank for the greedy pick, as one word: the value's bits in an order that unsigned
// comparison keeps, then the index inverted, so the largest rank is the largest logit with the
// lowest index among equals, as torch.argmax picks. NaN ranks as -inf: never picked unless
// the whole row is, as the Triton sampler reads it. Every rank is above 0, the counter's reset.
__device__ __forceinline__ unsigned long long greedy_rank(float value, int index) {
  uint32_t bits = __float_as_uint(value != value ? -INFINITY : value);
  bits = bits & 0x80000000u ? ~bits : bits | 0x80000000u;
  return (unsigned long long)bits << 32 | (0xffffffffu - (uint32_t)index);
}

// The step's greedy token from every block's best rank: the warp's, then the block's (in
// shared memory, one atomic per warp), then the grid's (one global atomic per block). The
// last block to count itself done reads the grid's rank, resetting it, writes the token and
// resets the count, so the next launch (a graph replay) starts from zeros. One launch fewer
// than a sampler pass after the kernel; a block's tail grows by two atomics' round trips.
__device__ __forceinline__ void pick_greedy(unsigned long long rank, const Vocab& vocab,
                                            unsigned long long* block_rank, int lane) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    rank = max(rank, __shfl_xor_sync(0xffffffffu, rank, offset));
  if (lane == 0) atomicMax(block_rank, rank);
  consumers_sync();
  if (threadIdx.x != 0) return;
  unsigned long long* const best = vocab.greedy_state;
  unsigned long long* const done = vocab.greedy_state + 1;
  atomicMax(best, *block_rank);
  __threadfence();  // this block's rank lands before it counts itself done
  if (atomicAdd(done, 1ull) != gridDim.x - 1) return;
  __threadfence();  // and the last block reads the rank only after every block's count
  const unsigned long long grid_rank = atomicExch(best, 0ull);
  atomicExch(done, 0ull);
  const int64_t token = 0xffffffffu - (uint32_t)grid_rank;
  *vocab.greedy_token = token;
  const uint64_t host = vocab.host_token == nullptr ? 0 : *vocab.host_token;
  if (host != 0) *reinterpret_cast<int64_t*>(host) = token;
}

// The final RMSNorm of the last layer's residual and the block's rows of the LM head. Warp w
// takes the block's slots w, w + CONSUMER_WARPS, ... and hands each back as soon as it has
// summed its rows, so the stream never waits on the whole block (a slice is ~140 slots).
__device__ __forceinline__ void head_stage(const Vocab& vocab, const __nv_bfloat16* residual,
                                           const uint32_t* tagged, uint32_t tag, uint4* staged,
                                           uint64_t* full, uint64_t* empty, const uint8_t* ring,
                                           uint32_t seq, float eps,
                                           unsigned long long* block_rank, int* failed) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float x[HIDDEN / 32];
  load_inputs<HIDDEN>(residual, tagged, tag, staged, full, seq, 0, lane, x, failed);
  const float scale = rms_scale<HIDDEN>(x, eps);
  // As the norm rounds its output to bf16 before the LM head reads it.
#pragma unroll
  for (int j = 0; j < HIDDEN / 256; ++j) {
    const int base = (j * 32 + lane) * 8;
    const float4 w0 = reinterpret_cast<const float4*>(vocab.norm + base)[0];
    const float4 w1 = reinterpret_cast<const float4*>(vocab.norm + base)[1];
    const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const __nv_bfloat16 b = __float2bfloat16(x[j * 8 + e] * scale * w[e]);
      x[j * 8 + e] = __bfloat162float(b);
      if (blockIdx.x == 0 && warp == 0) vocab.normed[base + e] = b;
    }
  }
  const Phase ph = head_slice(vocab.size);
  constexpr int PER_SLOT = rows_per_slot(HIDDEN);
  const int slots = ceil_div(ph.end_row - ph.first_row, PER_SLOT);
  unsigned long long rank = 0;  // the best logit this lane stored, for the greedy pick
  for (int i = warp; i < slots; i += CONSUMER_WARPS) {
    const uint32_t s = seq + i, slot = s % SLOTS, use = s / SLOTS;
    // The slot's previous use (SLOTS before) is another warp's, and may not have landed yet:
    // a parity wait for this use would then pass at once, on that use's phase. Its release
    // (which follows its landing) is waited for first; the producer is then at most this use
    // ahead, so the parity wait is for the right phase.
    if (s >= SLOTS) mbarrier_wait(&empty[slot], (use - 1) & 1, failed);
    mbarrier_wait(&full[slot], use & 1, failed);
    const uint8_t* rows = ring + slot * SLOT_BYTES;
    const int first = ph.first_row + i * PER_SLOT, n = min(PER_SLOT, ph.end_row - first);
    float sums[PER_SLOT];
#pragma unroll
    for (int r = 0; r < PER_SLOT; ++r)
      sums[r] = r < n ? lane_dot<HIDDEN>(rows + r * HIDDEN * 2, lane, x) : 0.f;
    const int r = warp_sum_scatter<PER_SLOT, 1>(sums, lane);
    __syncwarp();  // every lane's reads of the slot are done before it is handed back
    if (lane == 0) mbarrier_arrive(&empty[slot]);
    if (r >= 0 && r < n) {
      const __nv_bfloat16 logit = __float2bfloat16(sums[0]);
      vocab.logits[first + r] = logit;
      rank = max(rank, greedy_rank(__bfloat162float(logit), first + r));
    }
  }
  if (vocab.greedy_token != nullptr) pick_greedy(rank, vocab, block_rank, lane);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    layer_chain(const Weights weights, __nv_bfloat16* residual,
                __nv_bfloat16* qkv, __nv_bfloat16* act, AttentionArgs attention,
                TaggedArgs tagged, Vocab vocab, unsigned int* arrived, int* failed,
                uint64_t* stamps, int layers, float eps) {
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ uint64_t full[SLOTS];
  __shared__ uint64_t empty[SLOTS];
  __shared__ uint4 staged[INTER / 8];  // the phase's input vector
  __shared__ float scratch[2 * CONSUMER_WARPS * GROUP * (1 + HEAD_DIM / 2)];  // attention's
  __shared__ int last_split;
  __shared__ unsigned long long block_rank;  // the greedy pick's best in this block

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
    block_rank = 0;
  }
  __syncthreads();

  if (warp == CONSUMER_WARPS) {  // the weight stream
    if (lane != 0 || NO_WEIGHTS) return;
    uint32_t seq = 0;
    for (int layer = 0; layer < layers; ++layer) {
      for (int p = 0; p < PHASES; ++p) {
        const Phase ph = phase_slice(p);
        const __nv_bfloat16* weight = phase_weight(weights, p, layer);
        const int per_slot = rows_per_slot(ph.k);
        for (int first = ph.first_row; first < ph.end_row; first += per_slot, ++seq) {
          const int slot = claim_slot(seq, INFLIGHT, full, empty, failed);
          const int rows = min(per_slot, ph.end_row - first);
          uint8_t* to = ring + slot * SLOT_BYTES;
          mbarrier_expect_bytes(&full[slot], rows * ph.k * 2);
          if (p == 2) {  // features [first / 2, + rows / 2): their gate rows, then their up rows
            const uint32_t half = rows / 2 * ph.k * 2;
            const __nv_bfloat16* gate = weight + (size_t)(first / 2) * ph.k;
            bulk_copy(to, gate, half, &full[slot]);
            bulk_copy(to + per_slot / 2 * ph.k * 2, gate + (size_t)INTER * ph.k, half, &full[slot]);
          } else {
            bulk_copy(to, weight + (size_t)first * ph.k, rows * ph.k * 2, &full[slot]);
          }
        }
      }
    }
    if (VOCAB) {
      const Phase ph = head_slice(vocab.size);
      const int per_slot = rows_per_slot(HIDDEN);
      for (int first = ph.first_row; first < ph.end_row; first += per_slot, ++seq) {
        const int slot = claim_slot(seq, HEAD_INFLIGHT, full, empty, failed);
        const uint32_t bytes = min(per_slot, ph.end_row - first) * HIDDEN * 2;
        mbarrier_expect_bytes(&full[slot], bytes);
        bulk_copy(ring + slot * SLOT_BYTES, vocab.head + (size_t)first * HIDDEN, bytes,
                  &full[slot]);
      }
    }
    return;
  }

  // The step's position, from device memory so that a captured graph serves every step.
  attention.context = *attention.position;
  attention.cos_sin += (size_t)attention.context * HEAD_DIM;
  // The first layer's input: VOCAB, the token's embedding row; else the residual row given.
  const __nv_bfloat16* const input =
      VOCAB ? vocab.embed + (size_t)vocab.tokens[*vocab.token_index] * HIDDEN : residual;
  // The residual rows this warp updates in phases 1 and 3 (the same partition of HIDDEN).
  float own[OWN_ROWS];
  {
    const Phase ph = phase_slice(1);
#pragma unroll
    for (int t = 0; t < OWN_ROWS; ++t) {
      const int row = ph.first_row + warp + t * CONSUMER_WARPS;
      own[t] = row < ph.end_row ? __bfloat162float(input[row]) : 0.f;
    }
  }
  // Each phase's slice once (the divisions by the grid are not free: run 211's profile), and
  // the phase loop unrolled so that its geometry is constant.
  Phase slices[PHASES];
#pragma unroll
  for (int p = 0; p < PHASES; ++p) slices[p] = phase_slice(p);
  uint32_t seq = 0;
  unsigned int barriers = 0;
  const unsigned int epoch = TAGGED ? *tagged.epoch : 0;
  for (int layer = 0; layer < layers; ++layer) {
    const uint32_t tag = layer_tag(epoch, layers, layer);
    const uint32_t previous_tag = layer_tag(epoch, layers, layer - 1);
#pragma unroll
    for (int stage = 0; stage < STAGES; ++stage) {
      if ((stage == ATTENTION_STAGE && !ATTENTION) ||
          (stage == MERGE_STAGE && !(ATTENTION && MERGE_AS_STAGE)))
        continue;
      Prefetched prefetched;
      if (stage == ATTENTION_STAGE && !STREAM_ONLY && !BARRIER_ONLY)
        prefetch_attention(attention, layer, prefetched);
      if (layer + stage > 0 && !STREAM_ONLY && !TAGGED)
        grid_wait(arrived, ++barriers * gridDim.x, failed);
      uint64_t* stamp = stamps == nullptr
                            ? nullptr
                            : stamps + ((size_t)blockIdx.x * layers * STAGES + layer * STAGES +
                                        stage) * STAMPS;
      if (stamp != nullptr && threadIdx.x == 0) stamp[GT_START] = now_ns();
      stamp_clock(stamp, CLK_START);
      if (stage == ATTENTION_STAGE) {
        if (STREAM_ONLY || BARRIER_ONLY) stamp_clock(stamp, CLK_INPUTS);
        if (!STREAM_ONLY && !BARRIER_ONLY)
          attention_stage(attention, layer, qkv, tagged, tag, prefetched, eps, scratch,
                          reinterpret_cast<uint2*>(staged), &last_split, stamp, failed);
        stamp_clock(stamp, CLK_SUMS);
        grid_arrive(arrived);
        stamp_clock(stamp, CLK_ARRIVED);
        if (stamp != nullptr && threadIdx.x == 0) stamp[GT_DONE] = now_ns();
        continue;
      }
      if (stage == MERGE_STAGE) {
        if (STREAM_ONLY || BARRIER_ONLY) stamp_clock(stamp, CLK_INPUTS);
        if (!STREAM_ONLY && !BARRIER_ONLY) merge_stage(attention, tagged, tag, stamp, failed);
        stamp_clock(stamp, CLK_SUMS);
        grid_arrive(arrived);
        stamp_clock(stamp, CLK_ARRIVED);
        if (stamp != nullptr && threadIdx.x == 0) stamp[GT_DONE] = now_ns();
        continue;
      }
      const int p = stage == QKV_STAGE ? 0 : stage - 2;  // the GEMV phase
      const Phase ph = slices[p];
      const int slots = ceil_div(ph.end_row - ph.first_row, rows_per_slot(ph.k));
      // TAGGED: the plain residual is only the first layer's input and the last one's output.
      __nv_bfloat16* const residual_out =
          !TAGGED || (p == 3 && layer == layers - 1) ? residual : nullptr;
      if (STREAM_ONLY) {  // wait for the slots, release them, nothing else
        if ((int)threadIdx.x < slots) {
          const uint32_t s = seq + threadIdx.x;
          mbarrier_wait(&full[s % SLOTS], (s / SLOTS) & 1, failed);
        }
      } else if (BARRIER_ONLY) {
      } else if (p == 0 || p == 2) {
        float x[HIDDEN / 32];
        const uint32_t* in = !TAGGED ? nullptr
                             : p == 2 ? tagged.residual_o
                             : layer > 0 ? tagged.residual_down : nullptr;
        load_inputs<HIDDEN>(p == 0 && layer == 0 ? input : residual, in,
                            p == 0 ? previous_tag : tag, staged, full, seq, slots,
                            lane, x, failed);
        stamp_clock(stamp, CLK_INPUTS);
        const float scale = rms_scale<HIDDEN>(x, eps);
        if (p == 0)
          consume_phase<HIDDEN, 0, units_per_warp(QKV)>(
              ph, x, scale, ring, seq, Out{TAGGED ? nullptr : qkv, tagged.qkv, tag}, own);
        else
          consume_phase<HIDDEN, 2, units_per_warp(INTER)>(
              ph, x, scale, ring, seq, Out{TAGGED ? nullptr : act, tagged.act, tag}, own);
      } else if (p == 1) {
        float x[Q / 32];
        load_inputs<Q>(ATTENTION ? attention.out : qkv,
                       !TAGGED ? nullptr : ATTENTION ? tagged.attn : tagged.qkv, tag, staged,
                       full, seq, slots, lane, x, failed);
        stamp_clock(stamp, CLK_INPUTS);
        consume_phase<Q, 1, OWN_ROWS>(ph, x, 1.f, ring, seq,
                                      Out{residual_out, tagged.residual_o, tag}, own);
      } else {
        float x[INTER / 32];
        load_inputs<INTER>(act, TAGGED ? tagged.act : nullptr, tag, staged, full, seq, slots,
                           lane, x, failed);
        stamp_clock(stamp, CLK_INPUTS);
        consume_phase<INTER, 3, OWN_ROWS>(ph, x, 1.f, ring, seq,
                                          Out{residual_out, tagged.residual_down, tag}, own);
      }
      stamp_clock(stamp, CLK_SUMS);
      grid_arrive(arrived);
      release_slots(empty, seq, slots);
      seq += slots;
      stamp_clock(stamp, CLK_ARRIVED);
      if (stamp != nullptr && threadIdx.x == 0) stamp[GT_DONE] = now_ns();
    }
  }
  if (VOCAB && !STREAM_ONLY && !BARRIER_ONLY) {
    if (!TAGGED) grid_wait(arrived, ++barriers * gridDim.x, failed);
    head_stage(vocab, residual, TAGGED ? tagged.residual_down : nullptr,
               layer_tag(epoch, layers, layers - 1), staged, full,
               empty, ring, seq, eps, &block_rank, failed);
  }
  // Every block read the epoch before its first output, which block 0's last stage waited on.
  if (TAGGED && blockIdx.x == 0 && threadIdx.x == 0) *tagged.epoch = epoch + 1;
}
