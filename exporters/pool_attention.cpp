// mirror_rt.PoolAttention: causal attention that reads each row's keys and values in place in the KV buffers,
// an ONNX Runtime custom op (CPU), with the numbers it uses (native_numbers.inc), QuantizeRows (quantize_rows.inc)
// and the ops' registration (pool_attention_ort.inc). Built on first use by exporters/native_op.py; see
// exporters/pool_kv.py.
//
// Inputs: q [B, T, H*D] and k [B, T, KVH*D] (rotated), v [B, T, KVH*D], the KV buffers [B, KVH, S, D] (float, or
// binary16 for the op PoolAttentionHalf), positions [B, T] int64. Outputs [B, T, H*D] and the buffers with this
// call's keys and values stored at their positions (in place: ONNX Runtime binds the buffers as both). Query head
// h reads KV head h / (H / KVH).
// A query at position p attends to keys 0..p of its own row, always with the same float operations in the same
// order (dot products over 16 lanes then a fixed tree, max, exp, sums over keys in order): its result does not
// depend on the call's other rows, on how many tokens the call holds, or on anything past p in the buffers.
// That is the losslessness contract (a window verified in one call equals the same tokens decoded one by one).

#include <cmath>
#ifdef __linux__
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>
#endif
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace {

#include "native_numbers.inc"
#include "worker_pool.inc"

struct Shape {
  int64_t rows, tokens, heads, kv_heads, capacity, dim;
};

// One query position of one row over the `rep` query heads of one KV head; `scores` holds rep x (n rounded up).
template <typename T>
void attend_generic(const Shape& s, const float* q, const T* keys, const T* values, int64_t n, float* out,
                    std::vector<float>& scores) {
  const int rep = static_cast<int>(s.heads / s.kv_heads), d = static_cast<int>(s.dim);
  const int64_t padded = (n + W - 1) / W * W;
  scores.resize(static_cast<size_t>(rep * padded));
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int r = 0; r < rep; ++r) {
    float* row = scores.data() + r * padded;
    for (int64_t j = 0; j < n; ++j) row[j] = dot(q + r * d, keys + j * d, d) * scale;
    for (int64_t j = n; j < padded; ++j) row[j] = -INFINITY;
    float top[W];
    for (int l = 0; l < W; ++l) top[l] = -INFINITY;
    for (int64_t j = 0; j < padded; j += W)
      for (int l = 0; l < W; ++l) top[l] = row[j + l] > top[l] ? row[j + l] : top[l];
    float m = top[0];
    for (int l = 1; l < W; ++l) m = top[l] > m ? top[l] : m;
    float sum[W] = {0};
    for (int64_t j = 0; j < padded; j += W) {
      float* x = row + j;
      for (int l = 0; l < W; ++l) x[l] -= m;
      exp_lanes(x);
      for (int l = 0; l < W; ++l) sum[l] += j + l < n ? x[l] : 0.0f;
    }
    const float inverse = 1.0f / tree_sum(sum);
    float* o = out + r * d;
    for (int i = 0; i < d; ++i) o[i] = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      const float w = row[j];
      const T* v = values + j * d;
      for (int i = 0; i < d; ++i) o[i] += w * widen(v[i]);
    }
    for (int i = 0; i < d; ++i) o[i] *= inverse;
  }
}

#ifdef __AVX512F__
// Four vectors -> the sum of each one's lanes, in lanes 0..3 (the rest zero): one fixed tree whatever the place
// of a vector among the four (halves of 256 bits, then of 128, then pairs of lanes).
inline __m512 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 t23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  // t01 = [a0: b0+b2, b1+b3 | a1: b0+b2, b1+b3]; u = per 128-bit block k: vector k's (b0+b2) + (b1+b3)
  const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t01, t23, 0x88), _mm512_shuffle_f32x4(t01, t23, 0xDD));
  const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));  // lanes (0+2, 1+3, 2+0, 3+1) of each block
  const __m512 w = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));  // every lane of block k: vector k's sum
  return _mm512_maskz_permutexvar_ps(0x000F, _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), w);
}

// Scores of the `rep` query heads of one KV head (d = 16 * CH) over keys 0..n-1, four keys at a time, each read
// once for all heads: a dot product summed over 16 lanes, then across them by reduce4; -inf past n up to `padded`.
template <int rep, int CH, typename T>
inline void scores_x16(const float* q, const T* keys, int64_t n, float scale, float* rows, int64_t padded) {
  constexpr int d = 16 * CH;
  __m512 qv[rep][CH];
  for (int r = 0; r < rep; ++r)
    for (int c = 0; c < CH; ++c) qv[r][c] = _mm512_loadu_ps(q + r * d + 16 * c);
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < n; j += 4) {
    const int live = n - j < 4 ? static_cast<int>(n - j) : 4;
    __m512 acc[rep][4];
    for (int k = 0; k < 4; ++k) {
      if (k >= live) {  // past the last key: zeros, which change no other key's sum
        for (int r = 0; r < rep; ++r) acc[r][k] = _mm512_setzero_ps();
        continue;
      }
      __m512 kv[CH];
      for (int c = 0; c < CH; ++c) kv[c] = load16(keys + (j + k) * d + 16 * c);
      for (int r = 0; r < rep; ++r) {
        __m512 a = _mm512_mul_ps(qv[r][0], kv[0]);
        for (int c = 1; c < CH; ++c) a = _mm512_fmadd_ps(qv[r][c], kv[c], a);
        acc[r][k] = a;
      }
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1);
    for (int r = 0; r < rep; ++r)
      _mm512_mask_storeu_ps(rows + r * padded + j, mask,
                            _mm512_mul_ps(reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), s));
  }
  for (int r = 0; r < rep; ++r)
    for (int64_t j = n; j < padded; ++j) rows[r * padded + j] = -INFINITY;
}

// attend() for d = 16 * CH: the steps of attend_generic, vectorized (its own bits, the same in every call shape);
// the `rep` query heads of one KV head share each key and value read.
template <int rep, int CH, typename T>
void attend_x16(const float* q, const T* keys, const T* values, int64_t n, float* out, std::vector<float>& scores) {
  constexpr int d = 16 * CH;
  const int64_t padded = (n + 15) / 16 * 16;
  scores.resize(static_cast<size_t>(rep * padded));
  scores_x16<rep, CH>(q, keys, n, 1.0f / std::sqrt(static_cast<float>(d)), scores.data(), padded);
  float inverse[rep];
  for (int r = 0; r < rep; ++r) {
    float* row = scores.data() + r * padded;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < padded; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(row + j));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < padded; j += 16) {
      const int live = n - j < 16 ? static_cast<int>(n - j) : 16;
      const __mmask16 mask = live == 16 ? 0xFFFF : static_cast<__mmask16>((1u << live) - 1);
      __m512 e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), m)));
      _mm512_storeu_ps(row + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, sum);
    inverse[r] = 1.0f / tree_sum(lanes);
  }
  __m512 o[rep][CH];  // values: sums over keys in order
  for (int r = 0; r < rep; ++r)
    for (int c = 0; c < CH; ++c) o[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m512 vv[CH];
    for (int c = 0; c < CH; ++c) vv[c] = load16(values + j * d + 16 * c);
    for (int r = 0; r < rep; ++r) {
      const __m512 w = _mm512_set1_ps(scores[r * padded + j]);
      for (int c = 0; c < CH; ++c) o[r][c] = _mm512_fmadd_ps(w, vv[c], o[r][c]);
    }
  }
  for (int r = 0; r < rep; ++r) {
    const __m512 scale_out = _mm512_set1_ps(inverse[r]);
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(out + r * d + 16 * c, _mm512_mul_ps(o[r][c], scale_out));
  }
}

template <typename T>
using Attend = void (*)(const float*, const T*, const T*, int64_t, float*, std::vector<float>&);

template <int CH, typename T>
Attend<T> vectorized_for(int64_t rep) {
  switch (rep) {  // the query heads of one KV head, in registers together
    case 1: return attend_x16<1, CH, T>;
    case 2: return attend_x16<2, CH, T>;
    case 3: return attend_x16<3, CH, T>;
    case 4: return attend_x16<4, CH, T>;
    case 5: return attend_x16<5, CH, T>;
    case 6: return attend_x16<6, CH, T>;
    default: return nullptr;
  }
}

template <typename T>
Attend<T> vectorized(int64_t dim, int64_t rep) {
  switch (dim) {
    case 32: return vectorized_for<2, T>(rep);
    case 64: return vectorized_for<4, T>(rep);
    case 96: return vectorized_for<6, T>(rep);
    case 128: return vectorized_for<8, T>(rep);
    default: return nullptr;
  }
}
#endif

#include "attention_avx2.inc"

template <typename T>
void attend(const Shape& s, const float* q, const T* keys, const T* values, int64_t n, float* out,
            std::vector<float>& scores) {
#ifdef __AVX512F__
  const int64_t rep = s.heads / s.kv_heads;
  if (Attend<T> f = vectorized<T>(s.dim, rep)) return f(q, keys, values, n, out, scores);
  if (rep > 6 && vectorized<T>(s.dim, 4)) {  // more heads than registers: groups of 4 (a head's bits are its own)
    for (int64_t first = 0; first < rep; first += 4)
      vectorized<T>(s.dim, std::min<int64_t>(4, rep - first))(q + first * s.dim, keys, values, n,
                                                              out + first * s.dim, scores);
    return;
  }
#endif
#ifdef MIRROR_RT_ATTENTION_AVX2
  if (s.dim % 16 == 0) return attend_avx2(s, q, keys, values, n, out, scores);
#endif
  attend_generic(s, q, keys, values, n, out, scores);
}

// Keys one query attends to: position + 1, within the buffer.
inline int64_t keys_of(const Shape& s, const int64_t* positions, int64_t unit) {
  const int64_t p = positions[unit];
  return p < 0 ? 0 : (p + 1 > s.capacity ? s.capacity : p + 1);
}

// While it lives, this thread's float operations flush subnormal results to zero and read subnormal inputs as zero
// (x86's FTZ and DAZ; elsewhere nothing changes); the thread's own mode is put back after. A softmax's far tail
// (weights clamped near 1e-38, times values) otherwise makes each multiply-add before a query's largest score a
// microcode assist: a 256-token prompt of the 7B-layout test file (random weights) spent ~1 s of 5.3 in them. Set
// by every thread that attends, so a query's bits stay the same whichever thread computes it, whatever mode the
// caller's thread is in.
class FlushSubnormals {
 public:
#if defined(__x86_64__) || defined(__i386__)
  FlushSubnormals() : mode_(_mm_getcsr()) { _mm_setcsr(mode_ | FTZ | DAZ); }
  ~FlushSubnormals() { _mm_setcsr(mode_); }
#else
  FlushSubnormals() {}
#endif
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;

 private:
#if defined(__x86_64__) || defined(__i386__)
  static constexpr unsigned int FTZ = 0x8000, DAZ = 0x0040;
  unsigned int mode_;
#endif
};

// Units first..last-1 of the call's work: unit u is query (row, token) u / KVH over KV head u % KVH.
template <typename T>
void run_units(const Shape& s, const float* q, const T* keys, const T* values, const int64_t* positions, float* out,
               int64_t first, int64_t last) {
  const FlushSubnormals flush;
  std::vector<float> scores;
  const int64_t rep = s.heads / s.kv_heads, width = s.heads * s.dim;
  for (int64_t unit = first; unit < last; ++unit) {
    const int64_t query = unit / s.kv_heads, h = unit % s.kv_heads, b = query / s.tokens;
    const int64_t base = (b * s.kv_heads + h) * s.capacity * s.dim, at = query * width + h * rep * s.dim;
    const int64_t n = keys_of(s, positions, query);
    if (n == 0)
      std::memset(out + at, 0, sizeof(float) * rep * s.dim);
    else
      attend(s, q + at, keys + base, values + base, n, out + at, scores);
  }
}

int g_threads = 1;              // threads the calls of this process may use together (mirror_rt_ops_threads)
thread_local int t_threads = 0;  // threads this thread's calls may use (its session's: mirror_rt_ops_call_threads)
std::atomic<int> g_running{0};  // unpinned calls running now: they share g_threads

// The cores the calling thread may run on (its helpers inherit them), 0 where unknown.
int caller_cores() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
  return 0;
}

// The threads a call made now from this thread may split over, never more than its session asked for (t_threads).
// A caller pinned to fewer cores than the process's calls may use together (Mirror's target on N - 1 cores, its draft
// on the last) takes its cores' count whatever else runs: its helpers run on its cores alone, so a call of another
// session takes none of them. An unpinned caller shares g_threads with the unpinned calls running now (`running`,
// itself included).
int split_threads(int cores, int running) {
  const bool pinned = cores > 0 && cores < g_threads;
  const int threads = pinned ? cores : g_threads / std::max(1, running);
  return std::max(1, t_threads ? std::min(threads, t_threads) : threads);
}

// A call's threads, counted among the unpinned calls running while it lives.
class CallThreads {
 public:
  CallThreads() : cores_(caller_cores()), counted_(!(cores_ > 0 && cores_ < g_threads)) {
    threads_ = split_threads(cores_, counted_ ? ++g_running : 0);
  }
  ~CallThreads() {
    if (counted_) --g_running;
  }
  CallThreads(const CallThreads&) = delete;
  CallThreads& operator=(const CallThreads&) = delete;
  int threads() const { return threads_; }

 private:
  int cores_;
  bool counted_;
  int threads_ = 1;
};

constexpr int64_t SPLIT_KEYS = 1 << 12;  // a call attending to fewer keys in all runs on its own thread (~0.1 ms)

// The call's keys and values k, v [B, T, KVH*D] into the buffers [B, KVH, S, D] at each token's position.
template <typename T>
void store(const Shape& s, const float* k, const float* v, T* keys, T* values, const int64_t* positions) {
  for (int64_t b = 0; b < s.rows; ++b)
    for (int64_t t = 0; t < s.tokens; ++t) {
      const int64_t p = positions[b * s.tokens + t];
      if (p < 0 || p >= s.capacity) continue;
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        const int64_t from = ((b * s.tokens + t) * s.kv_heads + h) * s.dim;
        const int64_t to = ((b * s.kv_heads + h) * s.capacity + p) * s.dim;
        for (int64_t i = 0; i < s.dim; ++i) {
          narrow(k[from + i], keys + to + i);
          narrow(v[from + i], values + to + i);
        }
      }
    }
}

template <typename T>
void compute(const Shape& s, const float* q, const T* keys, const T* values, const int64_t* positions, float* out) {
  const int64_t units = s.rows * s.tokens * s.kv_heads;
  int64_t total = 0;
  for (int64_t query = 0; query < s.rows * s.tokens; ++query) total += keys_of(s, positions, query);
  total *= s.kv_heads;
  const CallThreads call;
  const int threads = total < SPLIT_KEYS ? 1 : call.threads();
  if (threads <= 1) {
    run_units(s, q, keys, values, positions, out, 0, units);
    return;
  }
  // contiguous ranges of units with like numbers of keys (a query's cost grows with its position)
  std::vector<int64_t> cuts{0};
  int64_t done = 0;
  for (int64_t unit = 0; unit < units && static_cast<int>(cuts.size()) < threads; ++unit) {
    done += keys_of(s, positions, unit / s.kv_heads);
    if (done * threads >= total * static_cast<int64_t>(cuts.size())) cuts.push_back(unit + 1);
  }
  cuts.push_back(units);
  workers().parallel(static_cast<int>(cuts.size()) - 1, [&](int i) {
    run_units(s, q, keys, values, positions, out, cuts[i], cuts[i + 1]);
  });
}

}  // namespace

extern "C" {

void mirror_rt_ops_threads(int threads) { g_threads = threads < 1 ? 1 : threads; }

// The threads the calls made from this thread may use (the session it runs asked for that many; 0: no limit).
void mirror_rt_ops_call_threads(int threads) { t_threads = threads < 0 ? 0 : threads; }

// The threads a call from this thread would split over with `running` unpinned calls running (itself included): the
// rule of split_threads, for tests.
int mirror_rt_ops_split_threads(int running) { return split_threads(caller_cores(), running); }

// The kernel without ONNX Runtime (tests call it through ctypes): keys and values as float, or as binary16
// (`_half`); with k and v (not null), this call's keys and values [B, T, KVH*D] are first stored at their positions.
int mirror_rt_pool_attention(const float* q, const float* k, const float* v, float* keys, float* values,
                             const int64_t* positions, float* out, int64_t rows, int64_t tokens, int64_t heads,
                             int64_t kv_heads, int64_t capacity, int64_t dim) {
  const Shape s{rows, tokens, heads, kv_heads, capacity, dim};
  if (k != nullptr && v != nullptr) store(s, k, v, keys, values, positions);
  compute<float>(s, q, keys, values, positions, out);
  return 0;
}

int mirror_rt_pool_attention_half(const float* q, const float* k, const float* v, uint16_t* keys, uint16_t* values,
                                  const int64_t* positions, float* out, int64_t rows, int64_t tokens, int64_t heads,
                                  int64_t kv_heads, int64_t capacity, int64_t dim) {
  const Shape s{rows, tokens, heads, kv_heads, capacity, dim};
  auto* keys16 = reinterpret_cast<half*>(keys);
  auto* values16 = reinterpret_cast<half*>(values);
  if (k != nullptr && v != nullptr) store(s, k, v, keys16, values16, positions);
  compute<half>(s, q, keys16, values16, positions, out);
  return 0;
}

#include "quantize_rows.inc"

}  // extern "C"

#include "gguf_matmul.inc"

#include "pool_attention_ort.inc"
