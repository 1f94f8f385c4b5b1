// Decode attention over one cache part on the CPU: an XLA FFI handler (kvjax/core/cpu_kernel.py).
// (Its other handlers, KvjaxFewRowsMatmul and KvjaxFewRowsMatmulT, are the decode step's 1-8-row
// weight products: x @ w and x @ w.T, the latter a tied embedding's logits.)
//
// One call continues the running softmax (m, l, acc) of `kvjax.core.attention.attend_blockwise`
// over the slots [0, length) of a part whose keys and values are each a dense float32 or
// bfloat16 array, or a bit-packed store (PackedTokens: per token, groups of channels;
// PackedChannels: per channel, a table row per group of tokens, KIVI's keys). Each slot is
// decoded into a D-float buffer that stays in L1 and is used at once: no float32 copy of a
// compressed cache is ever written. Work items are (row, chunk of slots), run on XLA's
// intra-op thread pool and the calling thread; each item keeps its own softmax state, merged
// per row at the end in the order of the chunks (the result does not depend on threading).
//
// Shapes: q [R, Q, D] f32; mask [R, Q, C] pred; m, l [R, Q] f32; acc [R, Q, D] f32;
// length [] s32. Per tensor (k, v): data [R, C, D] (dense) or [R, C, W] u32 words, ids
// [R, C] s16 (PackedChannels) or empty, scale/offset [R, C, D/G] (PackedTokens) or
// [R, NG, D] (PackedChannels) in f16/bf16/f32, or empty.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -1e30f;  // kvjax.core.attention.NEG_INF

typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

// ---- 16-lane vectors: one register with AVX-512, two native halves without ----
//
// The kernel's unit is 16 lanes (a tile of 16 slots, a 16-channel block). With AVX-512 that is
// one register. Without it GCC has no 16-float vector mode: a 64-byte vector type lives on the
// stack and every operation on it goes through memory (each broadcast became 16 scalar stores;
// the few-rows matmul read its weights at 4.4 GB/s a core against XLA's 13.4 on an AVX2 EPYC,
// docs/DECISIONS.md). There a 16-lane vector is a pair of 8-lane vectors whose operators act
// on both halves, which GCC keeps in registers. Same 64-byte layout; load16 and store16 below
// move it (a memcpy of the whole pair went through the stack).
#ifdef __AVX512F__
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
constexpr int kWideRegisters = 32;  // 16-lane vectors the register file holds

inline f32x16 to_f32(u32x16 x) { return __builtin_convertvector(x, f32x16); }
inline u32x16 widen(u16x16 x) { return __builtin_convertvector(x, u32x16); }
inline u32x16 lane_index() { return u32x16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }
inline u32x16 repeated(u32x8 h) {
  return __builtin_shufflevector(h, h, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
}
#else
template <typename H, typename E>
struct Pair {  // lanes [0, N) in lo, [N, 2N) in hi
  H lo, hi;
  Pair& operator+=(Pair b) { return lo += b.lo, hi += b.hi, *this; }
};
#define KVJAX_PAIR_OP(op)                                                                     \
  template <typename H, typename E>                                                           \
  inline Pair<H, E> operator op(Pair<H, E> a, Pair<H, E> b) { return {a.lo op b.lo, a.hi op b.hi}; } \
  template <typename H, typename E>                                                           \
  inline Pair<H, E> operator op(E a, Pair<H, E> b) { return {a op b.lo, a op b.hi}; }         \
  template <typename H, typename E>                                                           \
  inline Pair<H, E> operator op(Pair<H, E> a, E b) { return {a.lo op b, a.hi op b}; }
KVJAX_PAIR_OP(+)
KVJAX_PAIR_OP(-)
KVJAX_PAIR_OP(*)
KVJAX_PAIR_OP(/)
KVJAX_PAIR_OP(&)
KVJAX_PAIR_OP(<<)
KVJAX_PAIR_OP(>>)
#undef KVJAX_PAIR_OP
typedef Pair<f32x8, float> f32x16;
typedef Pair<u32x8, uint32_t> u32x16;
constexpr int kWideRegisters = 8;  // 16 ymm registers

inline f32x16 to_f32(u32x16 x) {
  return {__builtin_convertvector(x.lo, f32x8), __builtin_convertvector(x.hi, f32x8)};
}
inline u32x16 widen(u16x16 x) {
  u16x8 lo, hi;
  std::memcpy(&lo, &x, 16);
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + 16, 16);
  return {__builtin_convertvector(lo, u32x8), __builtin_convertvector(hi, u32x8)};
}
inline u32x16 lane_index() { return {u32x8{0, 1, 2, 3, 4, 5, 6, 7}, u32x8{8, 9, 10, 11, 12, 13, 14, 15}}; }
inline u32x16 repeated(u32x8 h) { return {h, h}; }
#endif
static_assert(sizeof(f32x16) == 64 && sizeof(u32x16) == 64, "16 lanes of 4 bytes");

// 16 lanes from p / to p, unaligned.
template <typename V, typename E>
inline V load16(const E* p) {
  V v;
#ifdef __AVX512F__
  std::memcpy(&v, p, sizeof v);
#else
  std::memcpy(&v.lo, p, sizeof v.lo);
  std::memcpy(&v.hi, p + 8, sizeof v.hi);
#endif
  return v;
}

template <typename V, typename E>
inline void store16(E* p, V v) {
#ifdef __AVX512F__
  std::memcpy(p, &v, sizeof v);
#else
  std::memcpy(p, &v.lo, sizeof v.lo);
  std::memcpy(p + 8, &v.hi, sizeof v.hi);
#endif
}

// The bits of x read as float32.
inline f32x16 as_f32(u32x16 x) {
#ifdef __AVX512F__
  return reinterpret_cast<f32x16>(x);
#else
  return {reinterpret_cast<f32x8>(x.lo), reinterpret_cast<f32x8>(x.hi)};
#endif
}

// Lanes [0, 8) + lanes [8, 16).
inline f32x8 halves_sum(f32x16 v) {
#ifdef __AVX512F__
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return v.lo + v.hi;
#endif
}

enum Format : int64_t { kDense = 0, kPackedTokens = 1, kPackedChannels = 2 };

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#ifdef __F16C__
inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#else
inline float f16_to_f32(uint16_t h) {  // IEEE half, with subnormals, inf and nan
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 0x400u));
      bits = sign | ((127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
#endif

inline float round_to_bf16(float x) {  // round to nearest even, as XLA's f32 -> bf16 convert
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7f800000u) != 0x7f800000u) bits += 0x7fffu + ((bits >> 16) & 1u);
  bits &= 0xffff0000u;
  std::memcpy(&x, &bits, 4);
  return x;
}

// exp(x) for x <= 0 (a score minus the running max) in a form the compiler vectorizes:
// 2^n e^r with |r| <= ln2/2 and Cephes' degree-5 polynomial for e^r (relative error about
// 2e-7, a float32 ulp or two). x is clamped at -87 (e^-87 is a normal float), so the masked
// scores (-1e30) give a tiny weight that the mask then zeroes.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// Parameters (scale/offset) as float32, whatever their stored dtype (U16: float16 bits, as
// kvjax.core.stores.stored_params keeps them). `stride` > 1: element i
// is entry i * stride (a PackedChannels table whose 16-bit scale and offset share a word: the
// scales are every other half, the offsets the halves after them).
struct Params {
  const void* data = nullptr;
  ffi::DataType type = ffi::DataType::F32;
  int64_t stride = 1;
  // Elements [start, start + n) to out, one dtype branch for the run.
  void load(int64_t start, int64_t n, float* __restrict out) const {
    if (stride != 1) {  // 16-bit halves: gathered into a contiguous run, then converted as one
      constexpr int64_t kRun = 256;
      uint16_t run[kRun];
      const uint16_t* h = static_cast<const uint16_t*>(data);
      for (int64_t i = 0; i < n; i += kRun) {
        const int64_t m = std::min(kRun, n - i);
        for (int64_t j = 0; j < m; ++j) run[j] = h[(start + i + j) * stride];
        Params{run, type}.load(0, m, out + i);
      }
      return;
    }
    const uint16_t* h = static_cast<const uint16_t*>(data) + start;
    switch (type) {
      case ffi::DataType::U16:
      case ffi::DataType::F16: {
        int64_t i = 0;
#ifdef __F16C__
        for (; i + 8 <= n; i += 8)  // 8 halves per conversion (the scalar one showed in profiles)
          _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                        reinterpret_cast<const __m128i*>(h + i))));
#endif
        for (; i < n; ++i) out[i] = f16_to_f32(h[i]);
        break;
      }
      case ffi::DataType::BF16:
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(h[i]);
        break;
      default:
        std::memcpy(out, static_cast<const float*>(data) + start, n * sizeof(float));
    }
  }
  float at(int64_t i) const {
    i *= stride;
    switch (type) {
      case ffi::DataType::U16:
      case ffi::DataType::F16: return f16_to_f32(static_cast<const uint16_t*>(data)[i]);
      case ffi::DataType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(data)[i]);
      default: return static_cast<const float*>(data)[i];
    }
  }
};

// Codes of `kBits` bits in strided planes (kvjax.core.quant.pack): channel p * words + i is bits
// [p * kBits, (p + 1) * kBits) of word i. Written as float32 to out[0, words * 32 / kBits).
template <int kBits>
inline void unpack(const uint32_t* __restrict w, float* __restrict out, int64_t words) {
  constexpr int kPlanes = 32 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1u;
  for (int p = 0; p < kPlanes; ++p) {
    float* o = out + p * words;
#pragma omp simd
    for (int64_t i = 0; i < words; ++i) o[i] = static_cast<float>((w[i] >> (p * kBits)) & kMask);
  }
}

// A per-thread buffer of at least n floats, one per use, kept across work items (a fresh vector
// per item showed in profiles as malloc + memset); its contents are whatever the last use left.
enum class Use { kScores, kRawParams, kKeyScales, kKeyOffsets, kValueScales, kValueOffsets,
                 kWeights, kQuerySums, kQueryPlanes, kAcc, kOffsetAcc, kProductParts, kNormWeight,
                 kRopeCos, kRopeSin };

// v with room for at least n elements: grown, never shrunk.
template <typename T>
void grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

template <Use kUse>
float* reused(int64_t n) {
  thread_local std::vector<float> buffer;
  grow(buffer, n);
  return buffer.data();
}

constexpr int64_t kPrefetchAhead = 4096;  // bytes (2-8 KiB measured alike, within noise)

// x [n, G] -> out [G, n] (kG: G when known at compile time).
template <int64_t kG>
inline void deinterleave(const float* __restrict x, int64_t n, float* __restrict out,
                         int64_t G = kG) {
  if constexpr (kG != 0) G = kG;
  for (int64_t g = 0; g < G; ++g)
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) out[g * n + t] = x[t * G + g];
}

// One tensor (keys or values) of a part, decoded a slot at a time.
struct Tensor {
  Format format;
  ffi::DataType type;  // dense: F32 or BF16
  const void* data;
  const int16_t* ids;  // PackedChannels: table row of each slot
  Params scale, offset;
  bool symmetric;
  int64_t bits, group, rows, slots, dim, table_rows;
  int64_t table_lanes;  // PackedChannels: table entries per group (make_tensor)

  // PackedChannels: table row `key` (row r's group: r * table_rows + group) as float32 scales
  // and offsets [dim] each (a symmetric store's offset is -2^(bits-1) x scale).
  void table_row(int64_t key, float* __restrict sc, float* __restrict off) const {
    scale.load(key * table_lanes, dim, sc);
    if (symmetric) {
      const float half = static_cast<float>(1 << (bits - 1));
      for (int64_t c = 0; c < dim; ++c) off[c] = -half * sc[c];
    } else {
      offset.load(key * table_lanes, dim, off);
    }
  }

  int64_t slot_bytes() const {
    if (format != kDense) return dim * bits / 8;
    return dim * (type == ffi::DataType::F32 ? 4 : 2);
  }

  // Asks the cache for slots [s, s + n) of row r's codes kPrefetchAhead bytes before they are
  // read: a work item streams its slots in order, and the hardware prefetcher alone left the
  // loads waiting on memory (a prefetch never faults, so the end of the buffer needs no check).
  void prefetch(int64_t r, int64_t s, int64_t n) const {
    const int64_t b = slot_bytes();
    const char* from = static_cast<const char*>(data) + (r * slots + s) * b + kPrefetchAhead;
    for (int64_t o = 0; o < n * b; o += 64) __builtin_prefetch(from + o);
  }

  // Slots [s, ...) of row r as float32 rows [*, dim] read in place, or nullptr unless dense
  // float32.
  const float* dense_f32(int64_t r, int64_t s) const {
    if (format != kDense || type != ffi::DataType::F32) return nullptr;
    return static_cast<const float*>(data) + (r * slots + s) * dim;
  }

  // Per-token scales and offsets of slots [s, s + n) of row r as float32, group-major:
  // sc[g * n + t], off[g * n + t] (a symmetric store's offset is -2^(bits-1) x scale). One
  // vectorized conversion per item instead of a converted scalar per slot and group.
  void token_params(int64_t r, int64_t s, int64_t n, float* __restrict sc,
                    float* __restrict off) const {
    const int64_t n_groups = dim / group, first = (r * slots + s) * n_groups;
    float* raw = reused<Use::kRawParams>(n * n_groups);  // [n, n_groups] as stored
    auto group_major = [&](const Params& from, float* __restrict to) {
      from.load(first, n * n_groups, raw);
      switch (n_groups) {  // constant strides vectorize (the runtime one stayed scalar)
        case 1: return std::memcpy(to, raw, n * sizeof(float)), void();
        case 2: return deinterleave<2>(raw, n, to);
        case 4: return deinterleave<4>(raw, n, to);
        default: return deinterleave<0>(raw, n, to, n_groups);
      }
    };
    group_major(scale, sc);
    if (!symmetric) return group_major(offset, off);
    const float half = static_cast<float>(1 << (bits - 1));
#pragma omp simd
    for (int64_t i = 0; i < n * n_groups; ++i) off[i] = -half * sc[i];
  }

  // Slot s of row r, decoded to out[0, dim). `table` keeps the last PackedChannels table row
  // converted to float32 ([2, dim]: scale, offset; `table_key` its index), so a row is
  // converted once per group of slots, not once per slot.
  void decode(int64_t r, int64_t s, float* __restrict out, float* __restrict table,
              int64_t& table_key) const {
    const int64_t slot = r * slots + s;
    if (format == kDense) {
      if (type == ffi::DataType::F32) {
        std::memcpy(out, static_cast<const float*>(data) + slot * dim, dim * sizeof(float));
      } else {
        const uint16_t* x = static_cast<const uint16_t*>(data) + slot * dim;
        for (int64_t c = 0; c < dim; ++c) out[c] = bf16_to_f32(x[c]);
      }
      return;
    }
    const int64_t words = dim * bits / 32;
    const uint32_t* w = static_cast<const uint32_t*>(data) + slot * words;
    switch (bits) {  // a predictable branch; each case unrolls its planes
      case 2: unpack<2>(w, out, words); break;
      case 4: unpack<4>(w, out, words); break;
      default: unpack<8>(w, out, words); break;
    }
    const float half = static_cast<float>(1 << (bits - 1));
    if (format == kPackedTokens) {  // one scale/offset per group of `group` channels
      const int64_t n_groups = dim / group, base = slot * n_groups;
      for (int64_t g = 0; g < n_groups; ++g) {
        const float sc = scale.at(base + g);
        const float off = symmetric ? -half * sc : offset.at(base + g);
        for (int64_t c = g * group; c < (g + 1) * group; ++c) out[c] = out[c] * sc + off;
      }
    } else {  // PackedChannels: the slot's table row, one scale/offset per channel
      const int64_t row = std::clamp<int64_t>(ids[slot], 0, table_rows - 1);
      const int64_t key = r * table_rows + row;
      float* sc = table;
      float* off = table + dim;
      if (key != table_key) {
        table_row(key, sc, off);
        table_key = key;
      }
#pragma omp simd
      for (int64_t c = 0; c < dim; ++c) out[c] = out[c] * sc[c] + off[c];
    }
  }
};

Tensor make_tensor(int64_t format, ffi::AnyBuffer data, ffi::AnyBuffer ids, ffi::AnyBuffer scale,
                   ffi::AnyBuffer offset, int64_t bits, int64_t group, bool symmetric,
                   int64_t dim) {
  auto dims = data.dimensions();
  Tensor t{};
  t.format = static_cast<Format>(format);
  t.type = data.element_type();
  t.data = data.untyped_data();
  t.ids = format == kPackedChannels ? static_cast<const int16_t*>(ids.untyped_data()) : nullptr;
  t.scale = Params{scale.untyped_data(), scale.element_type()};
  t.offset = Params{offset.untyped_data(), offset.element_type()};
  if (format == kPackedChannels) {
    // the lane-flat table (kvjax.core.stores.PackedChannels) as [R, NG, L]: in the parameters'
    // dtype (offsets, if any, at entries [D, 2D) of a row: float32), or uint32 words each
    // holding a channel's 16-bit scale (low half) and offset, whose dtype the empty `offset`
    // array names
    const bool paired = scale.element_type() == ffi::DataType::U32;
    const int64_t entry = scale.element_type() == ffi::DataType::F32 ? 4 : 2;  // bytes
    t.table_lanes = scale.dimensions()[2];
    if (paired) t.scale.type = offset.element_type();
    t.scale.stride = paired ? 2 : 1;
    t.offset = t.scale;
    t.offset.data = static_cast<const char*>(scale.untyped_data()) + (paired ? 1 : dim) * entry;
  }
  t.symmetric = symmetric;
  t.bits = bits;
  t.group = group;
  t.rows = dims[0];
  t.slots = dims[1];
  t.dim = dim;
  t.table_rows = format == kPackedChannels ? scale.dimensions()[1] : 0;
  return t;
}

struct Problem {
  Tensor k, v;
  const float* q;      // [R, Q, D]
  const bool* mask;    // [R, Q, C]
  int64_t rows, n_q, dim, slots, length, chunk, chunks;
  float scale, softcap;
  bool round_p;        // values are bf16: weights rounded to bf16 as XLA's dot does
  std::vector<float> m, l, acc;  // per item: [Q], [Q], [Q, D]
};

constexpr int64_t kTile = 16;  // slots scored together, one per vector lane

// Per-thread buffers of one work item.
struct Scratch {
  std::vector<float> buf;          // [D] one decoded slot
  std::vector<float> k_table;      // [2, D] the last key table row (scale, offset)
  std::vector<float> v_table;      // [2, D] the same for values
  std::vector<float> q_scaled;     // [Q, D] queries times the key table row's scales
  std::vector<float> q_offset;     // [Q] queries . the key table row's offsets
  std::vector<uint32_t> words_t;   // [W, kTile] a tile's packed key words, slot-minor
  int64_t k_key = -1, v_key = -1, q_key = -1;

  // This thread's scratch, sized for Q queries of D channels, no table row held. Kept across
  // work items: per-item vectors cost 6 allocations an item (~200 a layer at batch 1).
  static Scratch& for_item(int64_t Q, int64_t D) {
    thread_local Scratch w;
    grow(w.buf, D);
    grow(w.k_table, 2 * D);
    grow(w.v_table, 2 * D);
    grow(w.q_scaled, Q * D);
    grow(w.q_offset, Q);
    grow(w.words_t, D * kTile);
    w.k_key = w.v_key = w.q_key = -1;
    return w;
  }
};

#ifdef __AVX512F__
// r[i] lane t <- r[t] lane i: 32-bit lanes of 16 vectors, four shuffle stages of 16 each.
inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // pairs of rows interleaved within 128-bit blocks
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + c], block k: column 4k + c of rows 4i..4i+3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i) {  // 128-bit blocks of row groups (0, 1) and (2, 3) paired
    for (int c = 0; c < 4; ++c) {
      t[8 * i + c] = _mm512_shuffle_i32x4(r[8 * i + c], r[8 * i + c + 4], 0x88);
      t[8 * i + c + 4] = _mm512_shuffle_i32x4(r[8 * i + c], r[8 * i + c + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {  // whole columns
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// r[i] lane t <- r[t] lane i: 32-bit lanes of 8 vectors, three shuffle stages.
inline void transpose_8x8(__m256i r[8]) {
  __m256i t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // r[4i + c], half k: column 4k + c of rows 4i..4i+3
    r[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // whole columns: rows 0-3 from r[c], rows 4-7 from r[c + 4]
    t[c] = _mm256_permute2x128_si256(r[c], r[c + 4], 0x20);
    t[c + 4] = _mm256_permute2x128_si256(r[c], r[c + 4], 0x31);
  }
  for (int i = 0; i < 8; ++i) r[i] = t[i];
}
#endif

// The packed words of n <= kTile slots (src [n, words]) transposed to out [words, kTile], one
// slot per lane; lanes past n hold 0 (code 0). Returns out.
inline const uint32_t* words_slot_minor(const uint32_t* src, int64_t words, int64_t n,
                                        uint32_t* out) {
#ifdef __AVX512F__
  if (n == kTile && words % 8 == 0) {  // 16 x 16 (or 16 x 8, zero-extended) register transposes
    for (int64_t i0 = 0; i0 < words; i0 += 16) {
      const int64_t m = std::min<int64_t>(16, words - i0);
      __m512i r[16];
      for (int64_t t = 0; t < kTile; ++t) {
        const uint32_t* row = src + t * words + i0;
        r[t] = m == 16 ? _mm512_loadu_si512(row)
                       : _mm512_zextsi256_si512(
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
      }
      transpose_16x16(r);
      for (int64_t i = 0; i < m; ++i) _mm512_storeu_si512(out + (i0 + i) * kTile, r[i]);
    }
    return out;
  }
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
  if (n == kTile && words % 8 == 0) {  // 8 x 8 register transposes, slots 0-7 then 8-15
    for (int64_t i0 = 0; i0 < words; i0 += 8) {
      for (int64_t h = 0; h < kTile; h += 8) {
        __m256i r[8];
        for (int64_t t = 0; t < 8; ++t)
          r[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (h + t) * words + i0));
        transpose_8x8(r);
        for (int64_t i = 0; i < 8; ++i)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (i0 + i) * kTile + h), r[i]);
      }
    }
    return out;
  }
#endif
  if (n == kTile) {  // one 16-lane gather per word
    for (int64_t i = 0; i < words; ++i)
#pragma omp simd
      for (int64_t t = 0; t < kTile; ++t) out[i * kTile + t] = src[t * words + i];
    return out;
  }
  for (int64_t t = 0; t < kTile; ++t)
    for (int64_t i = 0; i < words; ++i) out[i * kTile + t] = t < n ? src[t * words + i] : 0u;
  return out;
}

// Codes are widened masked in place: plane p of a word as float32 code x 2^plane_exponent(p),
// no shift down; the caller scales its other factor by 2^-plane_exponent(p) (plane_scaled),
// which leaves every product unchanged (exact: at most 8 significant bits). The top plane
// reaches bit 31, and without AVX-512 x86 has no unsigned int -> float instruction (GCC emulates
// one in five: two halves converted and added); a signed one is exact below 2^31, so there the
// top plane is taken one bit lower (its exponent 32 - kBits - 1) and converted as signed.
#ifdef __AVX512F__
constexpr int kTopPlaneDrop = 0;  // vcvtudq2ps
#else
constexpr int kTopPlaneDrop = 1;
#endif

constexpr int plane_exponent(int64_t p, int64_t bits) {
  return static_cast<int>(p * bits - (p == 32 / bits - 1 ? kTopPlaneDrop : 0));
}

// Masked plane bits (each lane < 2^31 without AVX-512: plane_exponent) as float32, exactly.
inline f32x16 codes_to_f32(u32x16 x) {
#ifdef __AVX512F__
  return to_f32(x);
#else
  typedef int32_t i32x8 __attribute__((vector_size(32)));
  return {__builtin_convertvector(reinterpret_cast<i32x8>(x.lo), f32x8),
          __builtin_convertvector(reinterpret_cast<i32x8>(x.hi), f32x8)};
#endif
}

// Plane p of 16 packed words (one slot's word per lane) as float32 code x 2^plane_exponent(p).
template <int kBits>
inline f32x16 plane_codes(u32x16 words, int64_t p) {
  const int e = plane_exponent(p, kBits);
  const uint32_t shift = static_cast<uint32_t>(p * kBits - e), mask = ((1u << kBits) - 1u) << e;
  return codes_to_f32((words >> shift) & mask);
}

// x [Q, D] with channel c (in bit plane c / (D * bits / 32)) times 2^-plane_exponent(plane), to
// pair with plane_codes: exact powers of two, so each product is the same float.
inline void plane_scaled(const float* x, int64_t Q, int64_t D, int64_t bits, float* out) {
  const int64_t words = D * bits / 32;
  for (int64_t i = 0; i < Q; ++i) {
    for (int64_t p = 0; p < 32 / bits; ++p) {
      const float factor = 1.0f / static_cast<float>(1u << plane_exponent(p, bits));  // exact
#pragma omp simd
      for (int64_t c = p * words; c < (p + 1) * words; ++c) out[i * D + c] = x[i * D + c] * factor;
    }
  }
}

// Scores (before `scale`) of queries q [Q, D] with the keys of slots [s0, s0 + kTile) of row r,
// all in table row `key` of a PackedChannels store: the table is folded into the queries
// (q . (code * sc + off) = (q * sc) . code + q . off), so each code is widened once and
// multiplied into kTile lanes. out [Q, kTile].
template <int kBits, int64_t kQ, int64_t kD>
void channel_tile_scores(const Tensor& k, int64_t Q, int64_t D, int64_t r, int64_t s0,
                         int64_t key, const float* q, Scratch& w, float* out, int64_t stride) {
  if constexpr (kQ != 0) Q = kQ;  // constant trip counts: the query loops unroll
  if constexpr (kD != 0) D = kD;
  if (key != w.q_key) {
    float* sc = w.k_table.data();
    float* off = sc + D;
    k.table_row(key, sc, off);
    w.k_key = -1;  // k_table now holds this row for the scores, not for `decode`
    for (int64_t i = 0; i < Q; ++i) {
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < D; ++c) {
        w.q_scaled[i * D + c] = q[i * D + c] * sc[c];
        dot += q[i * D + c] * off[c];
      }
      w.q_offset[i] = dot;
    }
    plane_scaled(w.q_scaled.data(), Q, D, kBits, w.q_scaled.data());
    w.q_key = key;
  }
  constexpr int kPlanes = 32 / kBits;
  const int64_t words = D / kPlanes;
  const uint32_t* src = static_cast<const uint32_t*>(k.data) + (r * k.slots + s0) * words;
  const uint32_t* wt = words_slot_minor(src, words, kTile, w.words_t.data());
  f32x16 acc[kQ ? kQ : 8];  // one slot per lane
  for (int64_t j = 0; j < Q; ++j) acc[j] = w.q_offset[j] + f32x16{};
  for (int64_t i = 0; i < words; ++i) {
    const u32x16 slot_words = load16<u32x16>(wt + i * kTile);
    for (int p = 0; p < kPlanes; ++p) {
      const f32x16 code = plane_codes<kBits>(slot_words, p);
      const int64_t c = p * words + i;
      for (int64_t j = 0; j < Q; ++j) acc[j] += w.q_scaled[j * D + c] * code;
    }
  }
  for (int64_t j = 0; j < Q; ++j) store16(out + j * stride, acc[j]);
}

// The table row shared by slots [s0, s0 + kTile) of row r, or -1 if they differ.
inline int64_t shared_table_row(const Tensor& k, int64_t r, int64_t s0) {
  const int16_t* ids = k.ids + r * k.slots + s0;
  for (int64_t t = 1; t < kTile; ++t)
    if (ids[t] != ids[0]) return -1;
  return r * k.table_rows + std::clamp<int64_t>(ids[0], 0, k.table_rows - 1);
}

constexpr int64_t kMaxPlane = 64;  // channels per bit plane of the fused per-token paths

// Whether a per-token store's bit planes (D * bits / 32 channels each) each lie in one group,
// so the fused per-token paths (one scale per plane) read it.
inline bool planes_in_groups(const Tensor& t, int64_t dim) {
  const int64_t plane = dim * t.bits / 32;
  return t.format == kPackedTokens && plane <= kMaxPlane && t.group % plane == 0;
}

// Scores (before `scale`) of queries q [Q <= 8, D] with the per-token keys of slots
// [s0, s0 + n), n <= kTile, of row r: out [Q, kTile] (lanes past n unread), rows `stride`
// apart. One slot per vector lane: each code is widened once and multiplied into the Q
// queries' lanes (q_planes: the queries plane_scaled); per group g the lanes' sums are scaled
// by each slot's scale and its offset enters as offset x (sum of the query over g) (`q_sums`
// [Q, D / group]). sc, off: the slots' scales and offsets (Tensor::token_params) from slot
// s0, groups `g_stride` apart.
template <int kBits, int64_t kQ, int64_t kD>
void token_tile_scores(const Tensor& k, int64_t Q, int64_t D, int64_t r, int64_t s0, int64_t n,
                       const float* q_planes, const float* q_sums, const float* sc,
                       const float* off, int64_t g_stride, Scratch& w, float* out,
                       int64_t stride) {
  if constexpr (kQ != 0) Q = kQ;  // constant trip counts: the query loops unroll
  if constexpr (kD != 0) D = kD;
  constexpr int kPlanes = 32 / kBits;
  const int64_t words = D / kPlanes, n_groups = D / k.group, planes_per_group = k.group / words;
  const uint32_t* src = static_cast<const uint32_t*>(k.data) + (r * k.slots + s0) * words;
  const uint32_t* wt = words_slot_minor(src, words, n, w.words_t.data());
  f32x16 acc[kQ ? kQ : 8] = {};  // one slot per lane
  for (int64_t g = 0; g < n_groups; ++g) {
    f32x16 part[kQ ? kQ : 8] = {};  // q . code over the group's channels
    for (int64_t p = g * planes_per_group; p < (g + 1) * planes_per_group; ++p) {
      for (int64_t i = 0; i < words; ++i) {
        const f32x16 code = plane_codes<kBits>(load16<u32x16>(wt + i * kTile), p);
        for (int64_t j = 0; j < Q; ++j) part[j] += q_planes[j * D + p * words + i] * code;
      }
    }
    // lanes past n read padding and go to scores no one reads (out has kTile lanes a row)
    const f32x16 sg = load16<f32x16>(sc + g * g_stride), og = load16<f32x16>(off + g * g_stride);
    for (int64_t j = 0; j < Q; ++j) acc[j] += sg * part[j] + og * q_sums[j * n_groups + g];
  }
  for (int64_t j = 0; j < Q; ++j) store16(out + j * stride, acc[j]);
}

// One level of `lane_sums` on N-lane vectors: a and b each hold N / L sums as segments of L
// lanes; the result holds a's then b's as segments of L / 2 lanes (each segment's halves added).
template <int N, int L>
constexpr int fold_lane(int i) {
  const int half = L / 2, n_in = N / L, g = i / half;
  return (g % n_in) * L + i % half + (g < n_in ? 0 : N);
}

template <int N, int L, typename V, size_t... I>
inline V fold_native(V a, V b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, fold_lane<N, L>(I)...) +
         __builtin_shufflevector(a, b, (fold_lane<N, L>(I) + L / 2)...);
}

template <int L>
inline f32x16 fold(f32x16 a, f32x16 b) {
#ifdef __AVX512F__
  return fold_native<16, L>(a, b, std::make_index_sequence<16>());
#else  // a's halves folded give the low half, b's the high one
  if constexpr (L == 16) return {a.lo + a.hi, b.lo + b.hi};
  else return {fold_native<8, L>(a.lo, a.hi, std::make_index_sequence<8>()),
               fold_native<8, L>(b.lo, b.hi, std::make_index_sequence<8>())};
#endif
}

// The sum of v's lanes (one output; `lane_sums` below does 16 at once).
inline float lane_sum(f32x16 v) {
  const f32x8 a = halves_sum(v);
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Lane t <- the sum of v[t]'s lanes: 15 pairs of shuffles and adds for 16 sums.
inline f32x16 lane_sums(f32x16 v[16]) {
  for (int i = 0; i < 8; ++i) v[i] = fold<16>(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i) v[i] = fold<8>(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 2; ++i) v[i] = fold<4>(v[2 * i], v[2 * i + 1]);
  return fold<2>(v[0], v[1]);
}

// Scores of kTile dense float32 keys (`keys` [kTile, D], D % 16 == 0) with q [Q, D]: each
// slot's products summed in a vector, then the 16 vectors' lanes summed together.
template <int64_t kQ, int64_t kD>
void dense_tile_scores(const float* keys, const float* q, int64_t Q, int64_t D, float* out,
                       int64_t stride) {
  if constexpr (kD != 0) D = kD;
  if constexpr (kQ != 0) Q = kQ;
  for (int64_t i = 0; i < Q; ++i) {
    f32x16 part[kTile];
    for (int64_t t = 0; t < kTile; ++t) {
      f32x16 sum = {};
      for (int64_t c = 0; c < D; c += 16) {
        f32x16 qv, kv;
        sum += load16<f32x16>(q + i * D + c) * load16<f32x16>(keys + t * D + c);
      }
      part[t] = sum;
    }
    const f32x16 scores = lane_sums(part);
    store16(out + i * stride, scores);
  }
}

// Scores (before `scale`) of slots [s0, s0 + n) of row r: out [Q, n], rows `stride` apart.
template <int64_t kQ, int64_t kD>
void tile_scores(const Problem& P, int64_t r, int64_t s0, int64_t n, const float* q, Scratch& w,
                 float* out, int64_t stride) {
  const int64_t Q = kQ ? kQ : P.n_q, D = kD ? kD : P.dim;
  const Tensor& k = P.k;
  if (k.format == kPackedChannels && n == kTile && Q <= 8) {
    const int64_t key = shared_table_row(k, r, s0);
    if (key >= 0) {
      switch (k.bits) {
        case 2: return channel_tile_scores<2, kQ, kD>(k, Q, D, r, s0, key, q, w, out, stride);
        case 4: return channel_tile_scores<4, kQ, kD>(k, Q, D, r, s0, key, q, w, out, stride);
        default: return channel_tile_scores<8, kQ, kD>(k, Q, D, r, s0, key, q, w, out, stride);
      }
    }
  }
  const float* dense = k.dense_f32(r, s0);  // dense float32 is read in place, no copy
  if (dense && n == kTile && D % 16 == 0) return dense_tile_scores<kQ, kD>(dense, q, Q, D, out, stride);
  float* buf = w.buf.data();
  for (int64_t t = 0; t < n; ++t) {
    const float* kt = dense ? dense + t * D : buf;
    if (!dense) k.decode(r, s0 + t, buf, w.k_table.data(), w.k_key);
    for (int64_t i = 0; i < Q; ++i) {
      const float* qi = q + i * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < D; ++c) dot += qi[c] * kt[c];
      out[i * stride + t] = dot;
    }
  }
}

constexpr int kValueTile = 4;  // slots whose dense values are added together (add_values_run)

// A slot's packed words (kvjax.core.quant.pack: channel p * W + i is bits [p * kBits, (p + 1) *
// kBits) of word i, W = kD * kBits / 32) laid out for 16-channel blocks: for W < 16 lane l
// holds word l % W (the same for every block), for W >= 16 nothing is needed up front.
template <int64_t W>
inline u32x16 repeated_words(const uint32_t* w) {
  if constexpr (W == 8) {
    u32x8 h;
    std::memcpy(&h, w, sizeof h);
    return repeated(h);
  } else if constexpr (W == 4) {
    u32x4 h;
    std::memcpy(&h, w, sizeof h);
    return repeated(__builtin_shufflevector(h, h, 0, 1, 2, 3, 0, 1, 2, 3));
  } else {
    return u32x16{};
  }
}

// Each lane's plane_exponent in the 16-channel block from channel c0 (c0 a multiple of 16) of a
// slot of W words (channel c is in plane c / W), and the drop that leads to it (0, or
// kTopPlaneDrop in the top plane).
template <int kBits, int64_t W>
struct BlockPlanes {
  u32x16 exponent, drop;
  explicit BlockPlanes(int64_t c0) {
    const u32x16 plane = (static_cast<uint32_t>(c0) + lane_index()) / static_cast<uint32_t>(W);
    drop = plane / static_cast<uint32_t>(32 / kBits - 1) * static_cast<uint32_t>(kTopPlaneDrop);
    exponent = plane * static_cast<uint32_t>(kBits) - drop;
  }
};

// The codes of channels [c0, c0 + 16) of the slot whose words are w (`rep` =
// repeated_words<W>(w)), as float32 code x 2^exponent in one vector: masked in place, as
// plane_codes, so exact; the caller unscales its sums.
template <int kBits, int64_t W>
inline f32x16 block_codes(const uint32_t* w, u32x16 rep, int64_t c0,
                          const BlockPlanes<kBits, W>& planes) {
  static_assert(W % 16 == 0 || 16 % W == 0, "a block's words are contiguous or repeated");
  u32x16 words = rep;
  if constexpr (W >= 16) words = load16<u32x16>(w + c0 % W);
  if constexpr (kTopPlaneDrop != 0) words = words >> planes.drop;
  return codes_to_f32(words & (((1u << kBits) - 1u) << planes.exponent));
}

// acc [Q, D] += weights p [Q, kN] (rows `p_stride` apart) times the dense float32 values
// v [kN, D], summed over the kN slots before one update of acc.
template <int64_t kQ, int64_t kD, int kN>
void add_dense_values(const Problem& P, const float* v, const float* p, int64_t p_stride,
                      float* acc) {
  const int64_t Q = kQ ? kQ : P.n_q, D = kD ? kD : P.dim;
  for (int64_t i = 0; i < Q; ++i) {
    float wi[kN];
    for (int j = 0; j < kN; ++j) wi[j] = p[i * p_stride + j];
    float* __restrict a = acc + i * D;
#pragma omp simd
    for (int64_t c = 0; c < D; ++c) {
      float t = 0.0f;
      for (int j = 0; j < kN; ++j) t += wi[j] * v[j * D + c];
      a[c] += t;
    }
  }
}

// 16-lane sums a register-tiled loop keeps in registers, leaving the rest of the register file
// to the operands streaming past.
constexpr int kSumRegisters = kWideRegisters * 3 / 4;

// 16-channel vectors per pass of a register-tiled loop with `rows` rows of sums: the largest
// divisor of `vectors` with rows x block sums in kSumRegisters (at least 1).
constexpr int sum_block(int vectors, int64_t rows) {
  const int most = rows < kSumRegisters ? static_cast<int>(kSumRegisters / rows) : 1;
  for (int d = most < vectors ? most : vectors; d > 1; --d)
    if (vectors % d == 0) return d;
  return 1;
}

// acc [kQ, kD] += weights p [kQ, n] (rows `p_stride` apart) times the dense float32 values v
// [n, kD] of slots [s, s + n) of row r: the sums stay in registers (kQ x kBlock vectors, at
// most kSumRegisters) while the slots stream past, kBlock 16-channel vectors per pass over the
// slots.
template <int64_t kQ, int64_t kD>
void add_dense_values_run(const Tensor& values, int64_t r, int64_t s, const float* v, int64_t n,
                          const float* p, int64_t p_stride, float* acc) {
  constexpr int kVectors = kD / 16;
  constexpr int kBlock = sum_block(kVectors, kQ);
  for (int c0 = 0; c0 < kVectors; c0 += kBlock) {
    f32x16 a[kQ][kBlock] = {};
    for (int64_t t = 0; t < n; ++t) {
      if (c0 == 0 && t % kTile == 0) values.prefetch(r, s + t, std::min(kTile, n - t));
      f32x16 vt[kBlock];
      for (int b = 0; b < kBlock; ++b) vt[b] = load16<f32x16>(v + t * kD + (c0 + b) * 16);
      for (int64_t i = 0; i < kQ; ++i) {
        const float w = p[i * p_stride + t];
        for (int b = 0; b < kBlock; ++b) a[i][b] += w * vt[b];
      }
    }
    for (int64_t i = 0; i < kQ; ++i)
      for (int b = 0; b < kBlock; ++b) {
        float* at = acc + i * kD + (c0 + b) * 16;
        store16(at, load16<f32x16>(at) + a[i][b]);
      }
  }
}

// acc [Q, kD] += the per-token codes of slots [s, s + n) of row r weighted by wsc [G, Q, n]
// (weight x the slot's scale of group g): the sums stay in registers (kRows x kBlock
// 16-channel vectors, as add_dense_values_run) while the slots stream past, each slot's codes
// widened in one vector per block, channel c scaled by 2^plane_exponent(plane(c))
// (block_codes; add_token_values_run unscales). Offsets are the caller's.
template <int kBits, int64_t kQ, int64_t kD>
void add_token_values(const Problem& P, int64_t r, int64_t s, int64_t n, const float* wsc,
                      float* acc) {
  constexpr int64_t W = kD * kBits / 32, kRows = kQ ? kQ : 8;
  constexpr int kVectors = kD / 16;
  constexpr int kBlock = sum_block(kVectors, kRows);
  const int64_t Q = kQ ? kQ : P.n_q;
  const Tensor& v = P.v;
  const uint32_t* src = static_cast<const uint32_t*>(v.data) + (r * v.slots + s) * W;  // [n, W]
  // symmetric codes are centred when widened (code - 2^(bits-1), exact), so no offset sum
  // cancels against the codes' sum
  const uint32_t centre = v.symmetric ? 1u << (kBits - 1) : 0u;
  for (int c0 = 0; c0 < kVectors; c0 += kBlock) {
    f32x16 a[kRows][kBlock] = {};
    for (int64_t t = 0; t < n; ++t) {
      if (c0 == 0 && t % kTile == 0) v.prefetch(r, s + t, std::min(kTile, n - t));
      const uint32_t* w = src + t * W;
      const u32x16 rep = repeated_words<W>(w);
      for (int b = 0; b < kBlock; ++b) {
        const int64_t c = (c0 + b) * 16;
        const BlockPlanes<kBits, W> planes(c);
        const f32x16 code = block_codes<kBits, W>(w, rep, c, planes) -
                            codes_to_f32(centre << planes.exponent);
        const float* wg = wsc + c / v.group * Q * n + t;  // [Q] rows n apart
        for (int64_t i = 0; i < Q; ++i) a[i][b] += wg[i * n] * code;
      }
    }
    for (int64_t i = 0; i < Q; ++i)
      for (int b = 0; b < kBlock; ++b) {
        float* at = acc + i * kD + (c0 + b) * 16;
        store16(at, load16<f32x16>(at) + a[i][b]);
      }
  }
}

// acc [Q, D] (zeros on entry) = weights p [Q, n] (rows `p_stride` apart) times the per-token
// values of slots [s, s + n) of row r (add_token_values); weight x offset goes to off_acc
// [Q, D / group] (one dot per query and group). The slots' scales are folded into the weights
// up front (wsc [G, Q, n]), so the slot loop reads no per-slot parameter.
template <int kBits, int64_t kQ, int64_t kD>
void add_token_values_run(const Problem& P, int64_t r, int64_t s, int64_t n, const float* p,
                          int64_t p_stride, float* acc, float* off_acc) {
  const int64_t Q = kQ ? kQ : P.n_q, n_groups = kD / P.v.group;
  float* sc = reused<Use::kValueScales>(n_groups * n);
  float* off = reused<Use::kValueOffsets>(n_groups * n);
  float* wsc = reused<Use::kWeights>(n_groups * Q * n);
  P.v.token_params(r, s, n, sc, off);
  for (int64_t g = 0; g < n_groups; ++g) {
    for (int64_t i = 0; i < Q; ++i) {
      const float* __restrict pi = p + i * p_stride;
      float* __restrict wi = &wsc[(g * Q + i) * n];
      const float* sg = &sc[g * n];
      const float* og = &off[g * n];
#pragma omp simd
      for (int64_t t = 0; t < n; ++t) wi[t] = pi[t] * sg[t];
      if (P.v.symmetric) continue;  // centred codes instead (add_token_values)
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t t = 0; t < n; ++t) dot += pi[t] * og[t];
      off_acc[i * n_groups + g] += dot;
    }
  }
  add_token_values<kBits, kQ, kD>(P, r, s, n, wsc, acc);
  plane_scaled(acc, Q, kD, kBits, acc);  // the codes' 2^plane_exponent, exactly undone
}

// acc [Q, D] += weights p [Q] (`p_stride` apart) times the values of slot s of row r, decoded
// into the scratch buffer (a per-token store scales its codes in place and adds weight x offset
// to off_acc [Q, D / group]).
template <int64_t kQ, int64_t kD>
void add_values(const Problem& P, int64_t r, int64_t s, const float* p, int64_t p_stride,
                Scratch& w, float* acc, float* off_acc) {
  const int64_t Q = kQ ? kQ : P.n_q, D = kD ? kD : P.dim;
  const Tensor& v = P.v;
  float* buf = w.buf.data();
  if (v.format != kPackedTokens) {
    v.decode(r, s, buf, w.v_table.data(), w.v_key);
  } else {
    const int64_t slot = r * v.slots + s, words = D * v.bits / 32;
    const uint32_t* src = static_cast<const uint32_t*>(v.data) + slot * words;
    switch (v.bits) {
      case 2: unpack<2>(src, buf, words); break;
      case 4: unpack<4>(src, buf, words); break;
      default: unpack<8>(src, buf, words); break;
    }
    const int64_t G = v.group, n_groups = D / G;
    const float half = static_cast<float>(1 << (v.bits - 1));
    for (int64_t g = 0; g < n_groups; ++g) {
      const float sc = v.scale.at(slot * n_groups + g);
      const float off = v.symmetric ? -half * sc : v.offset.at(slot * n_groups + g);
      for (int64_t c = g * G; c < (g + 1) * G; ++c) buf[c] *= sc;
      for (int64_t i = 0; i < Q; ++i) off_acc[i * n_groups + g] += p[i * p_stride] * off;
    }
  }
  for (int64_t i = 0; i < Q; ++i) {
    const float pi = p[i * p_stride];
    float* a = acc + i * D;
#pragma omp simd
    for (int64_t c = 0; c < D; ++c) a[c] += pi * buf[c];
  }
}

// acc [Q, D] (zeros on entry) = weights p [Q, n] (rows `p_stride` apart) times the values of slots
// [s, s + n) of row r, each slot read once: dense float32 in place and per-token codes widened in
// registers (their sums kept in registers over the slots), anything else decoded slot by slot.
template <int64_t kQ, int64_t kD>
void add_values_run(const Problem& P, int64_t r, int64_t s, int64_t n, const float* p,
                    int64_t p_stride, Scratch& w, float* acc, float* off_acc) {
  const int64_t Q = kQ ? kQ : P.n_q, D = kD ? kD : P.dim;
  if (const float* v = P.v.dense_f32(r, s)) {
    if constexpr (kQ != 0 && kD != 0 && kD % 16 == 0)
      return add_dense_values_run<kQ, kD>(P.v, r, s, v, n, p, p_stride, acc);
    int64_t t = 0;
    for (; t + kValueTile <= n; t += kValueTile) {
      P.v.prefetch(r, s + t, kValueTile);
      add_dense_values<kQ, kD, kValueTile>(P, v + t * D, p + t, p_stride, acc);
    }
    for (; t < n; ++t) add_dense_values<kQ, kD, 1>(P, v + t * D, p + t, p_stride, acc);
    return;
  }
  if constexpr (kD != 0 && kD % 16 == 0) {
    if (P.v.format == kPackedTokens && P.v.group % 16 == 0 && Q <= 8) {
      auto run = P.v.bits == 2 ? add_token_values_run<2, kQ, kD>
                 : P.v.bits == 4 ? add_token_values_run<4, kQ, kD>
                                 : add_token_values_run<8, kQ, kD>;
      return run(P, r, s, n, p, p_stride, acc, off_acc);
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    P.v.prefetch(r, s + t, 1);
    add_values<kQ, kD>(P, r, s + t, p + t, p_stride, w, acc, off_acc);
  }
}

// Scores [Q, n] (rows `stride` apart) -> the weights exp(s - m) where `mask` (rows P.slots
// apart, 0 or 1) is visible, 0 elsewhere, in place, after P.scale, P.softcap and (P.round_p)
// bf16 rounding; m [Q] and l [Q] get each query row's max and sum of weights.
inline void softmax_weights(const Problem& P, float* scores, int64_t stride, const bool* mask,
                            int64_t Q, int64_t n, float* m, float* l) {
  for (int64_t i = 0; i < Q; ++i) {
    float* __restrict si = &scores[i * stride];
    const uint8_t* __restrict vis = reinterpret_cast<const uint8_t*>(mask + i * P.slots);
#pragma omp simd
    for (int64_t s = 0; s < n; ++s) si[s] *= P.scale;
    if (P.softcap > 0.0f)
      for (int64_t s = 0; s < n; ++s) si[s] = P.softcap * std::tanh(si[s] / P.softcap);
#pragma omp simd
    for (int64_t s = 0; s < n; ++s) si[s] = vis[s] != 0 ? si[s] : kNegInf;
    float mi = kNegInf;
#pragma omp simd reduction(max : mi)
    for (int64_t s = 0; s < n; ++s) mi = mi > si[s] ? mi : si[s];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t s = 0; s < n; ++s) {
      si[s] = exp_nonpositive(si[s] - mi) * static_cast<float>(vis[s]);
      sum += si[s];
    }
    if (P.round_p)
      for (int64_t s = 0; s < n; ++s) si[s] = round_to_bf16(si[s]);
    m[i] = mi;
    l[i] = sum;
  }
}

// The softmax state of one (row, chunk) item over its slots, from scratch. `kQ` query rows
// and `kD` channels are compile-time constants for the common shapes (0: read from P).
template <int64_t kQ, int64_t kD>
void run_item(Problem& P, int64_t item) {
  const int64_t Q = kQ ? kQ : P.n_q, D = kD ? kD : P.dim;
  const int64_t r = item / P.chunks, j = item % P.chunks;
  const int64_t lo = j * P.chunk, hi = std::min(P.length, lo + P.chunk);
  float* m = &P.m[item * Q];
  float* l = &P.l[item * Q];
  float* out = &P.acc[item * Q * D];
  std::fill(m, m + Q, kNegInf);
  std::fill(l, l + Q, 0.0f);
  std::fill(out, out + Q * D, 0.0f);
  if (lo >= hi) return;
  const int64_t n = hi - lo, tiles = (n + kTile - 1) / kTile;
  Scratch& w = Scratch::for_item(Q, D);
  float* scores = reused<Use::kScores>(Q * tiles * kTile);  // [Q, tiles * kTile]
  const int64_t stride = tiles * kTile;
  const float* q = P.q + r * Q * D;
  if (planes_in_groups(P.k, D) && Q <= 8) {  // pass 1: scores, keys read once
    const int64_t n_groups = D / P.k.group;
    float* q_sums = reused<Use::kQuerySums>(Q * n_groups);  // [Q, D / group]
    std::fill(q_sums, q_sums + Q * n_groups, 0.0f);
    for (int64_t i = 0; i < Q; ++i)
      for (int64_t c = 0; c < D; ++c) q_sums[i * n_groups + c / P.k.group] += q[i * D + c];
    float* q_planes = reused<Use::kQueryPlanes>(Q * D);
    float* sc = reused<Use::kKeyScales>(n_groups * n + kTile);  // lanes past n: padding
    float* off = reused<Use::kKeyOffsets>(n_groups * n + kTile);
    P.k.token_params(r, lo, n, sc, off);
    auto tile = P.k.bits == 2 ? token_tile_scores<2, kQ, kD>
                : P.k.bits == 4 ? token_tile_scores<4, kQ, kD> : token_tile_scores<8, kQ, kD>;
    plane_scaled(q, Q, D, P.k.bits, q_planes);
    for (int64_t t0 = 0; t0 < n; t0 += kTile) {
      P.k.prefetch(r, lo + t0, std::min(kTile, n - t0));
      tile(P.k, Q, D, r, lo + t0, std::min(kTile, n - t0), q_planes, q_sums,
           &sc[t0], &off[t0], n, w, &scores[t0], stride);
    }
  } else {
    for (int64_t t0 = 0; t0 < n; t0 += kTile) {
      P.k.prefetch(r, lo + t0, std::min(kTile, n - t0));
      tile_scores<kQ, kD>(P, r, lo + t0, std::min(kTile, n - t0), q, w, &scores[t0], stride);
    }
  }
  softmax_weights(P, &scores[0], stride, P.mask + r * Q * P.slots + lo, Q, n, m, l);
  const int64_t n_groups = P.v.format == kPackedTokens ? D / P.v.group : 0;
  float* acc = reused<Use::kAcc>(Q * D);  // [Q, D]
  float* off_acc = reused<Use::kOffsetAcc>(Q * n_groups);  // [Q, D / group]
  std::fill(acc, acc + Q * D, 0.0f);
  std::fill(off_acc, off_acc + Q * n_groups, 0.0f);
  add_values_run<kQ, kD>(P, r, lo, n, scores, stride, w, acc, off_acc);
  const int64_t G = n_groups ? P.v.group : D;  // channels per offset (none: one group of D)
  for (int64_t i = 0; i < Q; ++i)
    for (int64_t g = 0; g * G < D; ++g) {
      const float o = n_groups ? off_acc[i * n_groups + g] : 0.0f;
#pragma omp simd
      for (int64_t c = g * G; c < (g + 1) * G; ++c) out[i * D + c] = acc[i * D + c] + o;
    }
}

using Item = void (*)(Problem&, int64_t);

template <int64_t kD>
Item item_for_rows(int64_t n_q) {
  switch (n_q) {
    case 1: return run_item<1, kD>;
    case 2: return run_item<2, kD>;
    case 3: return run_item<3, kD>;
    case 4: return run_item<4, kD>;
    case 6: return run_item<6, kD>;
    case 8: return run_item<8, kD>;
    default: return run_item<0, kD>;
  }
}

Item item_for(int64_t n_q, int64_t dim) {
  switch (dim) {
    case 64: return item_for_rows<64>(n_q);
    case 128: return item_for_rows<128>(n_q);
    default: return item_for_rows<0>(n_q);
  }
}

// Runs items [0, n) on the calling thread and pool.num_threads() - 1 helpers (XLA sizes its
// pool to the cores; one helper more would leave three threads on two cores, and a call
// waits for its slowest thread: 20-25% slower products); returns when all are done. The caller,
// done with its share, spins up to kSpinWait before it sleeps: a step makes ~150 such calls and
// a helper usually finishes within microseconds of the caller (a sleep and wake-up cost more).
constexpr std::chrono::microseconds kSpinWait{20};

inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F&& body) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, n, &body]() {
    int64_t finished = 0;
    for (int64_t i; (i = shared->next.fetch_add(1)) < n; ++finished) body(i);
    if (finished && shared->done.fetch_add(finished) + finished == n) {
      std::lock_guard<std::mutex> lock(shared->mu);  // after the count: the waiter cannot miss it
      shared->cv.notify_all();
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n - 1);
  for (int64_t t = 0; t < helpers; ++t) {
    // A helper that starts after every item is taken returns at once without touching `body`.
    pool.Schedule([shared, n, work]() mutable {
      if (shared->next.load() < n) work();
    });
  }
  work();
  const auto until = std::chrono::steady_clock::now() + kSpinWait;
  while (shared->done.load() < n && std::chrono::steady_clock::now() < until)
    for (int i = 0; i < 16; ++i) spin_pause();
  if (shared->done.load() == n) return;
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == n; });
}

ffi::Error DecodeAttention(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::PRED> mask,
    ffi::Buffer<ffi::F32> m_in, ffi::Buffer<ffi::F32> l_in, ffi::Buffer<ffi::F32> acc_in,
    ffi::Buffer<ffi::S32> length, ffi::AnyBuffer k_data, ffi::AnyBuffer k_ids,
    ffi::AnyBuffer k_scale, ffi::AnyBuffer k_offset, ffi::AnyBuffer v_data,
    ffi::AnyBuffer v_ids, ffi::AnyBuffer v_scale, ffi::AnyBuffer v_offset,
    ffi::ResultBuffer<ffi::F32> m_out, ffi::ResultBuffer<ffi::F32> l_out,
    ffi::ResultBuffer<ffi::F32> acc_out, int64_t k_format, int64_t k_bits, int64_t k_group,
    bool k_symmetric, int64_t v_format, int64_t v_bits, int64_t v_group, bool v_symmetric,
    float scale, float softcap, bool round_p, int64_t chunk) {
  auto qd = q.dimensions();
  if (qd.size() != 3) return ffi::Error::InvalidArgument("q must be [R, Q, D]");
  Problem P;
  P.rows = qd[0];
  P.n_q = qd[1];
  P.dim = qd[2];
  P.slots = mask.dimensions()[2];
  P.k = make_tensor(k_format, k_data, k_ids, k_scale, k_offset, k_bits, k_group, k_symmetric,
                    P.dim);
  P.v = make_tensor(v_format, v_data, v_ids, v_scale, v_offset, v_bits, v_group, v_symmetric,
                    P.dim);
  if (P.k.slots != P.slots || P.v.slots != P.slots || P.k.rows != P.rows || P.v.rows != P.rows)
    return ffi::Error::InvalidArgument("keys, values, mask and queries disagree on [R, C]");
  P.q = q.typed_data();
  P.mask = mask.typed_data();
  P.length = std::clamp<int64_t>(length.typed_data()[0], 0, P.slots);
  P.scale = scale;
  P.softcap = softcap;
  P.round_p = round_p;
  P.chunk = std::max<int64_t>(1, chunk);
  P.chunks = std::max<int64_t>(1, (P.length + P.chunk - 1) / P.chunk);
  const int64_t Q = P.n_q, D = P.dim, items = P.rows * P.chunks;
  P.m.resize(items * Q);
  P.l.resize(items * Q);
  P.acc.resize(items * Q * D);
  const Item run = item_for(Q, D);
  parallel_for(pool, items, [&P, run](int64_t item) { run(P, item); });

  // Merge: the incoming state, then each chunk in order (as the blockwise loop does).
  const float* mi = m_in.typed_data();
  const float* li = l_in.typed_data();
  const float* ai = acc_in.typed_data();
  float* mo = m_out->typed_data();
  float* lo = l_out->typed_data();
  float* ao = acc_out->typed_data();
  for (int64_t r = 0; r < P.rows; ++r) {
    for (int64_t i = 0; i < Q; ++i) {
      const int64_t ri = r * Q + i;
      float m = mi[ri];
      for (int64_t j = 0; j < P.chunks; ++j) m = std::max(m, P.m[(r * P.chunks + j) * Q + i]);
      const float c_in = std::exp(mi[ri] - m);
      float l = li[ri] * c_in;
      float* a = ao + ri * D;
      for (int64_t c = 0; c < D; ++c) a[c] = ai[ri * D + c] * c_in;
      for (int64_t j = 0; j < P.chunks; ++j) {
        const int64_t item = r * P.chunks + j;
        const float cj = std::exp(P.m[item * Q + i] - m);
        l += P.l[item * Q + i] * cj;
        const float* aj = &P.acc[(item * Q + i) * D];
        for (int64_t c = 0; c < D; ++c) a[c] += aj[c] * cj;
      }
      mo[ri] = m;
      lo[ri] = l;
    }
  }
  return ffi::Error::Success();
}


// ---- Few-row matmul: y [R, N] = x [R, K] @ w [K, N] for a decode step's weights ----
//
// XLA:CPU runs a dot of 2-8 rows through a GEMM library call that costs about twice the
// one-row dot although both read the same weights, and compiles each one-row dot to its own
// loop (docs/DECISIONS.md). Here w is split into blocks of contiguous rows, one work item
// each, streamed once (kMatmulTileRows rows at a time in 32- or 16-column tiles whose R x 32 or
// R x 16 sums stay in registers); the blocks' partial sums are added in block order, so the
// result does not depend on the threads.

constexpr int64_t kMatmulMaxRows = 8;
constexpr int64_t kMatmulParallelBytes = 256 << 10;  // smaller weights run on one thread
// Rows of w per pass over the columns: each is a stream of reads the prefetchers follow. 16 on
// the AVX-512 Xeon where this was tuned; on an AVX2 EPYC 16 streams read at 13 GB/s, 4 at 18
// (XLA's dot: 19-20, docs/DECISIONS.md).
#ifdef __AVX512F__
constexpr int64_t kMatmulTileRows = 16;
#else
constexpr int64_t kMatmulTileRows = 4;
#endif

// Columns [c, c + 16) of row k of w as float32 (bf16 widened exactly).
template <bool kBf16>
inline f32x16 weight_vector(const void* w, int64_t N, int64_t k, int64_t c) {
  if constexpr (kBf16) {
    u16x16 h;
    std::memcpy(&h, static_cast<const uint16_t*>(w) + k * N + c, sizeof h);
    return as_f32(widen(h) << 16u);
  } else {
    return load16<f32x16>(static_cast<const float*>(w) + k * N + c);
  }
}

// part [R, N] += x[:, k0:k1] @ w[k0:k1, c:c + 16 * kV] for R = kR rows: the kR x kV sums stay
// in registers while the rows of w stream past; the same columns of the next kMatmulTileRows
// rows are prefetched.
template <int kR, int kV, bool kBf16>
inline void matmul_tile(const float* x, const void* w, int64_t K, int64_t N, int64_t k0,
                        int64_t k1, int64_t c, float* part) {
  const char* bytes = static_cast<const char*>(w);
  const int64_t elem = kBf16 ? 2 : 4;
  f32x16 acc[kR][kV];
  for (int r = 0; r < kR; ++r)
    for (int v = 0; v < kV; ++v) acc[r][v] = load16<f32x16>(part + r * N + c + 16 * v);
  for (int64_t k = k0; k < k1; ++k) {
    for (int v = 0; v < kV; ++v)
      __builtin_prefetch(bytes + ((k + kMatmulTileRows) * N + c + 16 * v) * elem);
    f32x16 wk[kV];
    for (int v = 0; v < kV; ++v) wk[v] = weight_vector<kBf16>(w, N, k, c + 16 * v);
    for (int r = 0; r < kR; ++r) {
      const float xr = x[r * K + k];
      for (int v = 0; v < kV; ++v) acc[r][v] += xr * wk[v];
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int v = 0; v < kV; ++v) store16(part + r * N + c + 16 * v, acc[r][v]);
}

// part [R, N] = x[:, k0:k1] @ w[k0:k1] for R = kR rows (N a multiple of 16), kMatmulTileRows
// rows of w at a time, each walked in 32-column tiles (16 where 2 x kR sums and 2 operands
// would fill the register file).
template <int kR, bool kBf16>
void matmul_rows(const float* x, const void* w, int64_t K, int64_t N, int64_t k0, int64_t k1,
                 float* part) {
  constexpr int kV = kR * 2 + 2 < kWideRegisters ? 2 : 1;
  std::fill(part, part + kR * N, 0.0f);
  for (int64_t kt = k0; kt < k1; kt += kMatmulTileRows) {
    const int64_t kn = std::min(k1, kt + kMatmulTileRows);
    int64_t c = 0;
    for (; c + 16 * kV <= N; c += 16 * kV) matmul_tile<kR, kV, kBf16>(x, w, K, N, kt, kn, c, part);
    if (c < N) matmul_tile<kR, 1, kBf16>(x, w, K, N, kt, kn, c, part);
  }
}

using Rows = void (*)(const float*, const void*, int64_t, int64_t, int64_t, int64_t, float*);

template <bool kBf16>
Rows rows_for(int64_t rows) {
  switch (rows) {
    case 1: return matmul_rows<1, kBf16>;
    case 2: return matmul_rows<2, kBf16>;
    case 3: return matmul_rows<3, kBf16>;
    case 4: return matmul_rows<4, kBf16>;
    case 5: return matmul_rows<5, kBf16>;
    case 6: return matmul_rows<6, kBf16>;
    case 7: return matmul_rows<7, kBf16>;
    default: return matmul_rows<8, kBf16>;
  }
}

// Work items for a weight of `w_bytes` split along its `rows` (blocks of contiguous rows): 2 per
// thread (some balance if a core is busy), each at least 16 rows; a small weight is one block
// (waking a helper would cost more than it saves).
inline int64_t weight_blocks(ffi::ThreadPool& pool, int64_t w_bytes, int64_t rows) {
  if (w_bytes < kMatmulParallelBytes) return 1;
  return std::max<int64_t>(1, std::min<int64_t>(2 * pool.num_threads(), rows / 16));
}

// y_i [R, N_i] = x [R, K] @ w_i [K, N_i] for each weight i (one call for a layer's q, k and v,
// say): every weight's blocks are work items of one parallel_for, so the products share one
// round of the pool instead of one round each.
ffi::Error FewRowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                         ffi::RemainingRets ys) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || ws.size() < 1 || ws.size() != ys.size())
    return ffi::Error::InvalidArgument("few-rows matmul: x [R, K], then n weights and n results");
  const int64_t R = xd[0], K = xd[1];
  if (R < 1 || R > kMatmulMaxRows)
    return ffi::Error::InvalidArgument("few-rows matmul: needs 1 <= R <= 8");
  struct Product {
    const void* w;
    float* y;
    int64_t N, blocks, block_rows;
    Rows rows;
    float* partial;  // [blocks, R, N]
  };
  std::vector<Product> products(ws.size());
  std::vector<int64_t> first_item(ws.size() + 1, 0);  // item -> product: first_item[i] <= item
  int64_t part_floats = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("few-rows matmul: weights and results must be arrays");
    auto wd = w->dimensions();
    const bool bf16 = w->element_type() == ffi::DataType::BF16;
    if (wd.size() != 2 || wd[0] != K || wd[1] % 16 != 0)
      return ffi::Error::InvalidArgument("few-rows matmul: each w must be [K, N], N % 16 == 0");
    if (!bf16 && w->element_type() != ffi::DataType::F32)
      return ffi::Error::InvalidArgument("few-rows matmul: w must be float32 or bfloat16");
    Product& p = products[i];
    p.w = w->untyped_data();
    p.y = (*y)->typed_data();
    p.N = wd[1];
    p.blocks = weight_blocks(pool, K * p.N * (bf16 ? 2 : 4), K);
    p.block_rows = (K + p.blocks - 1) / p.blocks;
    p.rows = bf16 ? rows_for<true>(R) : rows_for<false>(R);
    first_item[i + 1] = first_item[i] + p.blocks;
    part_floats += p.blocks * R * p.N;
  }
  // reused: a fresh allocation per call page-faults (and a lambda would read another thread's
  // thread_local, so the pointer is taken here)
  float* next = reused<Use::kProductParts>(part_floats);
  for (Product& p : products) {
    p.partial = next;
    next += p.blocks * R * p.N;
  }
  const float* xp = x.typed_data();
  parallel_for(pool, first_item.back(), [&](int64_t item) {
    const size_t i = std::upper_bound(first_item.begin(), first_item.end(), item) -
                     first_item.begin() - 1;
    const Product& p = products[i];
    const int64_t b = item - first_item[i];
    const int64_t k0 = std::min(K, b * p.block_rows), k1 = std::min(K, k0 + p.block_rows);
    p.rows(xp, p.w, K, p.N, k0, k1, p.partial + b * R * p.N);
  });
  for (const Product& p : products) {  // blocks' sums added in block order: thread-independent
    std::copy(p.partial, p.partial + R * p.N, p.y);
    for (int64_t b = 1; b < p.blocks; ++b) {
      const float* pb = p.partial + b * R * p.N;
#pragma omp simd
      for (int64_t j = 0; j < R * p.N; ++j) p.y[j] += pb[j];
    }
  }
  return ffi::Error::Success();
}

// ---- y [R, N] = x [R, K] @ w [N, K]^T: a tied embedding's logits for a decode step ----
//
// Each output is the dot of a row of w (contiguous K values) with a row of x, so w is read
// once, row after row, in blocks of rows (one work item each) that write their own outputs:
// no partial sums to add. kE rows of w go together so kE x R sums are in flight.


// y[:, n0:n1] for kR rows of x, kE rows of w at a time (the last n1 - n0 % kE one by one).
template <int kR, int kE, bool kBf16>
void matmul_t_rows(const float* x, const void* w, int64_t K, int64_t N, int64_t n0, int64_t n1,
                   float* y) {
  const char* bytes = static_cast<const char*>(w);
  const int64_t elem = kBf16 ? 2 : 4;
  int64_t n = n0;
  for (; n + kE <= n1; n += kE) {
    f32x16 acc[kE][kR] = {};
    for (int64_t k = 0; k < K; k += 16) {
      f32x16 wv[kE];
      for (int e = 0; e < kE; ++e) {
        __builtin_prefetch(bytes + ((n + e + 4 * kE) * K + k) * elem);
        wv[e] = weight_vector<kBf16>(w, K, n + e, k);
      }
      for (int r = 0; r < kR; ++r) {
        const f32x16 xv = load16<f32x16>(x + r * K + k);
        for (int e = 0; e < kE; ++e) acc[e][r] += wv[e] * xv;
      }
    }
    for (int e = 0; e < kE; ++e)
      for (int r = 0; r < kR; ++r) y[r * N + n + e] = lane_sum(acc[e][r]);
  }
  if constexpr (kE > 1) matmul_t_rows<kR, 1, kBf16>(x, w, K, N, n, n1, y);
}

using RowsT = void (*)(const float*, const void*, int64_t, int64_t, int64_t, int64_t, float*);

// Rows of w a kR-row product walks together: 4, 2 or 1, at most kWideRegisters / 4 sums (8
// with AVX-512) in flight.
constexpr int t_rows_for(int rows) {
  int e = 4;
  while (e > 1 && e * rows > kWideRegisters / 4) e /= 2;
  return e;
}

template <bool kBf16>
RowsT rows_t_for(int64_t rows) {
  switch (rows) {
    case 1: return matmul_t_rows<1, t_rows_for(1), kBf16>;
    case 2: return matmul_t_rows<2, t_rows_for(2), kBf16>;
    case 3: return matmul_t_rows<3, t_rows_for(3), kBf16>;
    case 4: return matmul_t_rows<4, t_rows_for(4), kBf16>;
    case 5: return matmul_t_rows<5, t_rows_for(5), kBf16>;
    case 6: return matmul_t_rows<6, t_rows_for(6), kBf16>;
    case 7: return matmul_t_rows<7, t_rows_for(7), kBf16>;
    default: return matmul_t_rows<8, t_rows_for(8), kBf16>;
  }
}

ffi::Error FewRowsMatmulT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                          ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("few-rows matmul_t: x must be [R, K] and w [N, K]");
  const int64_t R = xd[0], K = xd[1], N = wd[0];
  if (R < 1 || R > kMatmulMaxRows || K % 16 != 0)
    return ffi::Error::InvalidArgument("few-rows matmul_t: needs 1 <= R <= 8 and K % 16 == 0");
  const bool bf16 = w.element_type() == ffi::DataType::BF16;
  if (!bf16 && w.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("few-rows matmul_t: w must be float32 or bfloat16");
  const int64_t blocks = weight_blocks(pool, N * K * (bf16 ? 2 : 4), N);
  const int64_t block_rows = (N + blocks - 1) / blocks;
  const RowsT rows = bf16 ? rows_t_for<true>(R) : rows_t_for<false>(R);
  const float* xp = x.typed_data();
  const void* wp = w.untyped_data();
  float* yp = y->typed_data();
  parallel_for(pool, blocks, [&](int64_t b) {
    const int64_t n0 = std::min(N, b * block_rows), n1 = std::min(N, n0 + block_rows);
    rows(xp, wp, K, N, n0, n1, yp);
  });
  return ffi::Error::Success();
}

// y = x * rsqrt(mean(x^2) + eps) * w per row: a decoder's RMS norm as one call (XLA:CPU
// compiles each norm to ~4 kernels of its own, ~15 ms of compile per norm; docs/DECISIONS.md).
ffi::Error RmsNorm(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y,
                   float eps) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 1 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("rms norm: x must be [R, K] and w [K]");
  if (w.element_type() != ffi::DataType::F32 && w.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("rms norm: w must be float32 or bfloat16");
  const int64_t R = xd[0], K = xd[1];
  float* weight = reused<Use::kNormWeight>(K);
  Params{w.untyped_data(), w.element_type()}.load(0, K, weight);
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x.typed_data() + r * K;
    float* yr = y->typed_data() + r * K;
    float lanes[16] = {};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
      for (int j = 0; j < 16; ++j) lanes[j] += xr[k + j] * xr[k + j];
    float squares = 0.0f;
    for (; k < K; ++k) squares += xr[k] * xr[k];
    for (int j = 0; j < 16; ++j) squares += lanes[j];
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(K) + eps);
    for (k = 0; k < K; ++k) yr[k] = xr[k] * inv * weight[k];
  }
  return ffi::Error::Success();
}

// RoPE, the rotate-half convention: per position p and frequency i < D/2, the pair
// (x_i, x_{i+D/2}) turned by the angle p * inv_freq[i], for every head. One call per tensor
// (XLA:CPU compiles each rotation to kernels of its own, 5-10 ms of compile per tensor).
ffi::Error Rope(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> positions,
                ffi::Buffer<ffi::F32> inv_freq, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  if (xd.size() != 3 || positions.dimensions().size() != 1 || positions.dimensions()[0] != xd[0]
      || inv_freq.dimensions().size() != 1 || 2 * inv_freq.dimensions()[0] != xd[2])
    return ffi::Error::InvalidArgument("rope: x must be [P, N, D], positions [P], inv_freq [D/2]");
  const int64_t P = xd[0], N = xd[1], D = xd[2], half = D / 2;
  float* cos_ = reused<Use::kRopeCos>(half);
  float* sin_ = reused<Use::kRopeSin>(half);
  for (int64_t p = 0; p < P; ++p) {
    const float at = static_cast<float>(positions.typed_data()[p]);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = at * inv_freq.typed_data()[i];
      cos_[i] = std::cos(angle);
      sin_[i] = std::sin(angle);
    }
    for (int64_t n = 0; n < N; ++n) {
      const float* xr = x.typed_data() + (p * N + n) * D;
      float* yr = y->typed_data() + (p * N + n) * D;
      for (int64_t i = 0; i < half; ++i) {
        yr[i] = xr[i] * cos_[i] - xr[i + half] * sin_[i];
        yr[i + half] = xr[i + half] * cos_[i] + xr[i] * sin_[i];
      }
    }
  }
  return ffi::Error::Success();
}

// f32 -> IEEE half bits, rounded to nearest even (XLA's convert): the normal range by the
// 13 dropped mantissa bits, the subnormal one in units of 2^-24 (a carry into the exponent
// field is the right result in both).
inline uint16_t f32_to_f16_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) return sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u);
  if (absx >= 0x47800000u) return sign | 0x7c00u;  // >= 2^16: beyond the half range
  if (absx < 0x38800000u) {                         // below 2^-14: subnormal or zero
    float a;
    std::memcpy(&a, &absx, 4);
    return sign | static_cast<uint16_t>(std::rint(a * 16777216.0f));  // a * 2^24, exact
  }
  uint32_t h = ((absx >> 23) - 112u) << 10 | ((absx >> 13) & 0x3ffu);
  const uint32_t rest = absx & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

// A quantization parameter in its stored dtype: `x` rounded toward +inf (up) or -inf, saturated
// at the dtype's largest finite value -- kvjax.core.quant.round_to, bit for bit. Returns the stored
// value as float32 (exact) and writes its bits.
struct Rounder {
  ffi::DataType type;
  float big;  // the dtype's largest finite value
  explicit Rounder(ffi::DataType t)
      : type(t), big(t == ffi::DataType::F16 ? 65504.0f
                     : t == ffi::DataType::BF16 ? 3.3895313892515355e38f
                                                : std::numeric_limits<float>::max()) {}
  float operator()(float x, bool up, void* out, int64_t i) const {
    x = std::min(std::max(x, -big), big);
    if (type == ffi::DataType::F32) {
      static_cast<float*>(out)[i] = x;
      return x;
    }
    uint16_t bits;
    float y;
    if (type == ffi::DataType::F16) {
      bits = f32_to_f16_bits(x);
      y = f16_to_f32(bits);
    } else {
      y = round_to_bf16(x);
      uint32_t b;
      std::memcpy(&b, &y, 4);
      bits = static_cast<uint16_t>(b >> 16);
    }
    if (up ? y < x : y > x) {  // one unit further in the bits, away from zero iff the sign says so
      const bool grows = (bits >> 15) != up;  // the sign bit (not std::signbit: -fno-signed-zeros)
      const uint16_t stepped = grows ? bits + 1 : bits - 1;
      const float s = type == ffi::DataType::F16 ? f16_to_f32(stepped) : bf16_to_f32(stepped);
      if (std::abs(s) <= big) bits = stepped, y = s;
    }
    static_cast<uint16_t*>(out)[i] = bits;
    return y;
  }
};

// Codes of x [M, I] (groups of `group` along M; `ok` [M] or null) and the groups' parameters at
// param index `at0 + g * I + i`: the arithmetic of `QuantizeGroups`. With channels (I > 1,
// KIVI's keys) the loops run over them innermost and vectorize; a token's groups (I == 1) run
// as plain loops over their contiguous elements.
struct GroupQuantizer {
  int64_t bits, group, I;
  bool symmetric;
  Rounder round;
  void* scale;
  void* offset;

  // A group's stored parameters from its range; returns the reciprocal of the scale and sets
  // `low` (the offset, 0 when symmetric). XLA divides by a constant, and by a group's
  // broadcast parameter, as a product with the reciprocal, and flushes a subnormal result to
  // zero: so does this, for equal codes.
  // Compiled without -fassociative-math: with it, a float32 scale came out one ulp off XLA's.
  __attribute__((optimize("no-associative-math")))
  float params(float lo, float hi, float absmax, int64_t at, float& low) const {
    const float levels = static_cast<float>((1 << bits) - 1);
    const float half = static_cast<float>(1 << (bits - 1));
    float step;
    low = 0.0f;
    if (symmetric) {
      step = round(absmax * (1.0f / (half - 1.0f)), true, scale, at);
    } else {
      low = round(lo, false, offset, at);
      step = round(((std::isfinite(hi) ? hi : low) - low) * (1.0f / levels), true, scale, at);
    }
    const float inv = 1.0f / (step > 0.0f ? step : 1.0f);
    return inv < std::numeric_limits<float>::min() ? 0.0f : inv;
  }

  uint32_t code(float v, float low, float inv) const {
    const float half = static_cast<float>(1 << (bits - 1));
    const float q = std::rint((v - low) * inv);  // nearest-even: the default rounding mode
    const float c = symmetric ? std::min(std::max(q, 1.0f - half), half - 1.0f) + half
                              : std::min(std::max(q, 0.0f), static_cast<float>((1 << bits) - 1));
    return c == c ? static_cast<uint32_t>(c) : 0u;  // NaN: 0, as XLA's convert
  }

  // `scratch`: 5 * I floats
  void operator()(const float* __restrict x, const bool* ok, int64_t M, int64_t at0,
                  uint32_t* __restrict codes, float* __restrict scratch) const {
    const float inf = std::numeric_limits<float>::infinity();
    for (int64_t m0 = 0; m0 < M; m0 += group) {
      const int64_t at = at0 + m0 / group * I;
      if (I == 1) {
        float lo = inf, hi = -inf, absmax = 0.0f, low;
        for (int64_t m = m0; m < m0 + group; ++m) {
          if (ok && !ok[m]) continue;
          lo = std::min(lo, x[m]), hi = std::max(hi, x[m]), absmax = std::max(absmax, std::abs(x[m]));
        }
        const float inv = params(lo, hi, absmax, at, low);
        for (int64_t m = m0; m < m0 + group; ++m) codes[m] = code(x[m], low, inv);
        continue;
      }
      float *lo = scratch, *hi = lo + I, *absmax = hi + I, *low = absmax + I, *inv = low + I;
      std::fill(lo, lo + I, inf);
      std::fill(hi, hi + I, -inf);
      std::fill(absmax, absmax + I, 0.0f);
      for (int64_t m = m0; m < m0 + group; ++m) {
        if (ok && !ok[m]) continue;
        const float* xm = x + m * I;
        for (int64_t i = 0; i < I; ++i) {
          lo[i] = std::min(lo[i], xm[i]);
          hi[i] = std::max(hi[i], xm[i]);
          absmax[i] = std::max(absmax[i], std::abs(xm[i]));
        }
      }
      for (int64_t i = 0; i < I; ++i) inv[i] = params(lo[i], hi[i], absmax[i], at + i, low[i]);
      for (int64_t m = m0; m < m0 + group; ++m)
        for (int64_t i = 0; i < I; ++i) codes[m * I + i] = code(x[m * I + i], low[i], inv[i]);
    }
  }
};

// Uniform quantization of x [O, M, I] in groups of G consecutive elements along M, packed in
// strided planes along x's last axis as the caller sees it: kvjax.core.quant.quantize + pack, bit for
// bit. Per-token (groups of channels): x [R, D, 1], params [R, D/G]; per-channel (KIVI keys,
// groups of tokens): x [R, T, D], params [R, T/G, D]. `valid` [O, M] (or empty: all valid)
// leaves elements out of their group's range, as `quantize(valid=...)`. One call per encode:
// XLA:CPU compiled each quantization to ~8 kernels of its own, most of an int8 decode
// program's compile time (docs/DECISIONS.md). Work items are whole packed rows (a token's
// groups; a channel group's G tokens), ~16k elements each, on XLA's thread pool.
ffi::Error QuantizeGroups(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<ffi::PRED> valid, ffi::ResultBuffer<ffi::U32> words,
                          ffi::Result<ffi::AnyBuffer> scale, ffi::Result<ffi::AnyBuffer> offset,
                          int64_t bits, int64_t group, bool symmetric) {
  auto xd = x.dimensions();
  const int64_t rank = xd.size();
  if (rank < 2 || !(bits == 2 || bits == 4 || bits == 8) || group < 1)
    return ffi::Error::InvalidArgument("quantize groups: x must be [..., M, I], bits 2, 4 or 8");
  const int64_t M = xd[rank - 2], I = xd[rank - 1];
  const int64_t O = x.element_count() / std::max<int64_t>(M * I, 1);
  const int64_t D = I > 1 ? I : M;  // the packed axis: channels
  const bool masked = valid.element_count() > 0;
  if (M % group || D % (32 / bits) || (masked && valid.element_count() != O * M))
    return ffi::Error::InvalidArgument("quantize groups: M must be a multiple of the group, the "
                                       "channels of 32 / bits, valid [..., M] or empty");
  const GroupQuantizer quantize{bits, group, I, symmetric, Rounder(scale->element_type()),
                                scale->untyped_data(), offset->untyped_data()};
  const int64_t per_word = 32 / bits, W = D / per_word;
  // a unit: what one packed row needs -- a token's M codes (I == 1) or G tokens' rows (I > 1)
  const int64_t unit_m = I > 1 ? group : M, units = O * M / std::max<int64_t>(unit_m, 1);
  const int64_t per_item = std::max<int64_t>(1, 16384 / std::max<int64_t>(unit_m * I, 1));
  parallel_for(pool, (units + per_item - 1) / per_item, [&](int64_t item) {
    std::vector<uint32_t> codes(unit_m * I);
    std::vector<float> scratch(5 * I);
    for (int64_t u = item * per_item; u < std::min(units, (item + 1) * per_item); ++u) {
      const int64_t m_first = u * unit_m;  // in [O * M]
      quantize(x.typed_data() + m_first * I, masked ? valid.typed_data() + m_first : nullptr,
               unit_m, m_first / group * I, codes.data(), scratch.data());
      for (int64_t r = 0; r < unit_m * I / D; ++r) {  // rows of D codes -> W words each
        const uint32_t* c = codes.data() + r * D;
        uint32_t* wr = words->typed_data() + (m_first * I / D + r) * W;
        for (int64_t w = 0; w < W; ++w) {
          uint32_t word = 0;
          for (int64_t p = 0; p < per_word; ++p) word |= c[p * W + w] << (p * bits);
          wr[w] = word;
        }
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KvjaxDecodeAttention, DecodeAttention,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // q
        .Arg<ffi::Buffer<ffi::PRED>>()  // mask
        .Arg<ffi::Buffer<ffi::F32>>()   // m
        .Arg<ffi::Buffer<ffi::F32>>()   // l
        .Arg<ffi::Buffer<ffi::F32>>()   // acc
        .Arg<ffi::Buffer<ffi::S32>>()   // length
        .Arg<ffi::AnyBuffer>()          // k data
        .Arg<ffi::AnyBuffer>()          // k ids
        .Arg<ffi::AnyBuffer>()          // k scale
        .Arg<ffi::AnyBuffer>()          // k offset
        .Arg<ffi::AnyBuffer>()          // v data
        .Arg<ffi::AnyBuffer>()          // v ids
        .Arg<ffi::AnyBuffer>()          // v scale
        .Arg<ffi::AnyBuffer>()          // v offset
        .Ret<ffi::Buffer<ffi::F32>>()   // m
        .Ret<ffi::Buffer<ffi::F32>>()   // l
        .Ret<ffi::Buffer<ffi::F32>>()   // acc
        .Attr<int64_t>("k_format")
        .Attr<int64_t>("k_bits")
        .Attr<int64_t>("k_group")
        .Attr<bool>("k_symmetric")
        .Attr<int64_t>("v_format")
        .Attr<int64_t>("v_bits")
        .Attr<int64_t>("v_group")
        .Attr<bool>("v_symmetric")
        .Attr<float>("scale")
        .Attr<float>("softcap")
        .Attr<bool>("round_p")
        .Attr<int64_t>("chunk"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KvjaxFewRowsMatmul, FewRowsMatmul,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // x [R, K]
        .RemainingArgs()                // w_i [K, N_i] f32 or bf16
        .RemainingRets());              // y_i [R, N_i] f32

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KvjaxFewRowsMatmulT, FewRowsMatmulT,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // x [R, K]
        .Arg<ffi::AnyBuffer>()          // w [N, K] f32 or bf16
        .Ret<ffi::Buffer<ffi::F32>>());  // y [R, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KvjaxRmsNorm, RmsNorm,
    ffi::Ffi::Bind()
        .Arg<ffi::Buffer<ffi::F32>>()   // x [R, K]
        .Arg<ffi::AnyBuffer>()          // w [K] f32 or bf16
        .Ret<ffi::Buffer<ffi::F32>>()   // y [R, K]
        .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KvjaxRope, Rope,
    ffi::Ffi::Bind()
        .Arg<ffi::Buffer<ffi::F32>>()   // x [P, N, D]
        .Arg<ffi::Buffer<ffi::S32>>()   // positions [P]
        .Arg<ffi::Buffer<ffi::F32>>()   // inv_freq [D/2]
        .Ret<ffi::Buffer<ffi::F32>>());  // y [P, N, D]

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KvjaxQuantizeGroups, QuantizeGroups,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // x [O, M, I]
        .Arg<ffi::Buffer<ffi::PRED>>()  // valid [O, M] or empty
        .Ret<ffi::Buffer<ffi::U32>>()   // words: x's codes packed along its channels
        .Ret<ffi::AnyBuffer>()          // scale [O, M / G, I] f16, bf16 or f32
        .Ret<ffi::AnyBuffer>()          // offset, as scale (asymmetric; untouched otherwise)
        .Attr<int64_t>("bits")
        .Attr<int64_t>("group")
        .Attr<bool>("symmetric"));
