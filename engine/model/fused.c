/* The decoder layer's small operations, fused, for the CPU: residual add + RMS norm, rotary
 * embedding + KV store, and SiLU-and-multiply. Each replaces four to ten torch operations
 * (and their temporaries) with one pass over the rows. Built and loaded by fused.py; see
 * there for why this exists.
 *
 * Numerics follow transformers' Llama modules operation by operation: values are computed
 * in float32 and, for bfloat16 models, rounded to bfloat16 wherever torch would store a
 * bfloat16 tensor (after each multiply of the rotary embedding, after the normalised
 * hidden state and again after the weight, after SiLU and after the multiply). Compiled
 * with -ffp-contract=off so no multiply-add is fused where torch rounds twice; only the
 * norm's sum of squares is reassociated (vectorized), as torch's reduction is too.
 *
 * Shapes (row-major, contiguous unless said): T rows (tokens) of
 * - rms_norm: x, residual, out [T, n]; weight [n].
 * - rope_kv: qkv [T, (H + 2 Hkv) D] (q heads, k heads, v heads); positions int64 [T];
 *   cos, sin [max_positions, D/2]; q_norm, k_norm [D] or NULL (Qwen3's per-head norms);
 *   q_out [T, H, D]; k_cache, v_cache one layer's pages [num_pages, page_size, Hkv, D]
 *   with pages `page_stride` elements apart and each page's rows contiguous; slots int64
 *   [T] (slot s is row s % page_size of page s / page_size).
 * - silu_mul: gate_up [T, 2 I] (gate | up); out [T, I].
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../fast_exp.h"

/* Below this many elements one thread does the whole call: waking the pool costs more. At
 * 16384, not 65536, a decode step at batch 32 (SiLU 49k elements, rotary 31k, norms 18k)
 * spends 3.25 against 4.0 ms in these kernels (bf16, `pdserve bench step`). */
#define PARALLEL_MIN 16384

static inline float bf16_load(uint16_t v) {
    union { uint32_t i; float f; } u = { .i = (uint32_t)v << 16 };
    return u.f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion. */
static inline uint16_t bf16_store(float f) {
    union { float f; uint32_t i; } u = { .f = f };
    if (f != f) return 0x7fc0;
    return (uint16_t)((u.i + 0x7fffu + ((u.i >> 16) & 1u)) >> 16);
}

static inline float f32_load(float v) { return v; }
static inline float f32_store(float v) { return v; }
static inline float f32_round(float v) { return v; }
static inline float bf16_round(float v) { return bf16_load(bf16_store(v)); }

#define DEFINE_KERNELS(SUFFIX, T, LOAD, STORE, ROUND)                                          \
                                                                                               \
/* Normalises the n values of src into dst: ROUND(w * ROUND(v / rms(v))). */                  \
static inline void norm_row_##SUFFIX(const T *restrict src, const T *restrict w,               \
                                     T *restrict dst, int64_t n, float eps) {                  \
    float ss = 0.0f;                                                                           \
    _Pragma("omp simd reduction(+ : ss)")                                                      \
    for (int64_t d = 0; d < n; d++) { const float v = LOAD(src[d]); ss += v * v; }             \
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);                                       \
    _Pragma("omp simd")                                                                        \
    for (int64_t d = 0; d < n; d++) dst[d] = STORE(LOAD(w[d]) * ROUND(LOAD(src[d]) * inv));   \
}                                                                                              \
                                                                                               \
/* residual += x (when residual is not NULL), then out = rms_norm(residual or x) * weight. */ \
int rms_norm_##SUFFIX(const T *x, T *residual, const T *weight, T *out, int64_t rows,          \
                      int64_t n, float eps, int threads) {                                     \
    _Pragma("omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN)")             \
    for (int64_t i = 0; i < rows; i++) {                                                       \
        const T *restrict xi = x + i * n;                                                      \
        if (residual) {                                                                        \
            T *restrict ri = residual + i * n;                                                 \
            _Pragma("omp simd")                                                                \
            for (int64_t d = 0; d < n; d++) ri[d] = STORE(LOAD(ri[d]) + LOAD(xi[d]));          \
            xi = ri;                                                                           \
        }                                                                                      \
        norm_row_##SUFFIX(xi, weight, out + i * n, n, eps);                                    \
    }                                                                                          \
    return 0;                                                                                  \
}                                                                                              \
                                                                                               \
/* One head of D values rotated into dst, after the optional per-head norm. */                 \
static inline void rope_head_##SUFFIX(const T *restrict src, T *restrict dst,                  \
                                      const T *restrict c, const T *restrict s,                \
                                      const T *restrict norm, float eps, int64_t D,            \
                                      T *restrict tmp) {                                       \
    if (norm) { norm_row_##SUFFIX(src, norm, tmp, D, eps); src = tmp; }                        \
    const int64_t half = D / 2;                                                                \
    _Pragma("omp simd")                                                                        \
    for (int64_t d = 0; d < half; d++) {                                                       \
        const float x1 = LOAD(src[d]), x2 = LOAD(src[d + half]);                               \
        const float cd = LOAD(c[d]), sd = LOAD(s[d]);                                          \
        dst[d] = STORE(ROUND(x1 * cd) - ROUND(x2 * sd));                                       \
        dst[d + half] = STORE(ROUND(x2 * cd) + ROUND(x1 * sd));                                \
    }                                                                                          \
}                                                                                              \
                                                                                               \
int rope_kv_##SUFFIX(const T *qkv, int64_t rows, int64_t H, int64_t Hkv, int64_t D,            \
                     const int64_t *positions, const T *cos, const T *sin,                     \
                     const T *q_norm, const T *k_norm, float eps, T *q_out,                    \
                     T *k_cache, T *v_cache, const int64_t *slots, int64_t page_size,          \
                     int64_t page_stride, int threads) {                                       \
    const int64_t width = (H + 2 * Hkv) * D, half = D / 2, kv_width = Hkv * D;                 \
    if (D > 1024 || D % 2) return 1;                                                           \
    _Pragma("omp parallel for num_threads(threads) if (rows * width >= PARALLEL_MIN)")         \
    for (int64_t t = 0; t < rows; t++) {                                                       \
        T tmp[1024];                                                                           \
        const T *row = qkv + t * width;                                                        \
        const T *c = cos + positions[t] * half, *s = sin + positions[t] * half;                \
        for (int64_t h = 0; h < H; h++)                                                        \
            rope_head_##SUFFIX(row + h * D, q_out + (t * H + h) * D, c, s, q_norm, eps, D, tmp); \
        const int64_t slot = slots[t];                                                         \
        const int64_t at = (slot / page_size) * page_stride + (slot % page_size) * kv_width;   \
        for (int64_t h = 0; h < Hkv; h++)                                                      \
            rope_head_##SUFFIX(row + (H + h) * D, k_cache + at + h * D, c, s, k_norm, eps, D, tmp); \
        memcpy(v_cache + at, row + (H + Hkv) * D, sizeof(T) * kv_width);                       \
    }                                                                                          \
    return 0;                                                                                  \
}                                                                                              \
                                                                                               \
/* out = ROUND(silu(gate)) * up, silu(g) = g / (1 + exp(-g)) as torch computes it. */          \
int silu_mul_##SUFFIX(const T *gate_up, T *out, int64_t rows, int64_t inter, int threads) {    \
    _Pragma("omp parallel for num_threads(threads) if (rows * inter >= PARALLEL_MIN)")         \
    for (int64_t i = 0; i < rows; i++) {                                                       \
        const T *restrict g = gate_up + i * 2 * inter, *restrict u = g + inter;                \
        T *restrict o = out + i * inter;                                                       \
        _Pragma("omp simd")                                                                    \
        for (int64_t d = 0; d < inter; d++) {                                                  \
            const float x = LOAD(g[d]);                                                        \
            o[d] = STORE(ROUND(x / (1.0f + fast_exp(-x))) * LOAD(u[d]));                     \
        }                                                                                      \
    }                                                                                          \
    return 0;                                                                                  \
}

DEFINE_KERNELS(f32, float, f32_load, f32_store, f32_round)
DEFINE_KERNELS(bf16, uint16_t, bf16_load, bf16_store, bf16_round)
