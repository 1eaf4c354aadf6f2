/* Paged decode attention for the CPU: one query token per sequence, reading each key and
 * value row once, straight from its page (no gathered copy of the context).
 *
 * Shapes: q and out float32 [B, H, D] (contiguous); k_cache, v_cache one layer's pages
 * [num_pages, page_size, Hkv, D] (float32 or bfloat16), each page's rows contiguous and
 * pages `page_stride` elements apart (the page-major pool interleaves every layer's K and
 * V between them); block_tables int32 [B, max_pages]; seq_lens int32 [B]. Position t of
 * sequence b is row t % page_size of page block_tables[b][t / page_size].
 * The H / Hkv query heads of one KV head share that head's keys (GQA without repeats).
 * One task is one sequence: its rows hold every KV head side by side, so reading them
 * whole keeps the reads sequential within a page. Exact softmax in two passes over the
 * context, in float32 (accumulating into `out`). Built and loaded by paged_decode.py;
 * see there for why this exists.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for x <= 0 (softmax of max-subtracted scores), within ~1 ulp of expf, written so
 * the compiler vectorizes it (libm's expf is a scalar call). Cody-Waite reduction with
 * explicit fmaf, so -fassociative-math cannot fold the two constants together. */
#pragma omp declare simd notinbranch
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(fmaf(x, 1.44269504088896341f, 0.5f));
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    union { int32_t i; float f; } two_n = { .i = ((int32_t)n + 127) << 23 };
    return p * two_n.f;
}

static inline const float *row_f32(const float *src, float *restrict tmp, int64_t W) {
    (void)tmp; (void)W;
    return src;
}

static inline const float *row_bf16(const uint16_t *restrict src, float *restrict tmp, int64_t W) {
    uint32_t *restrict t = (uint32_t *)tmp;
    _Pragma("omp simd")
    for (int64_t i = 0; i < W; i++) t[i] = (uint32_t)src[i] << 16;
    return tmp;
}

/* Per sequence: pass 1 scores every row for all H heads (each K row read once, its KV
 * head's G query heads dotted against it together), keeping a running max per head; then
 * exp and sums per head (vectorized over heads, scores stored [t][H]); pass 2 adds every V
 * row into all H outputs. No divisions in the inner loops: pages are walked in order. */
#define PAGED_DECODE(NAME, KV_T, ROW)                                                          \
    int NAME(const float *q, const KV_T *k_cache, const KV_T *v_cache,                         \
             const int32_t *block_tables, int64_t max_pages, const int32_t *seq_lens,          \
             int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t page_size,                 \
             int64_t page_stride, float scale,                                                 \
             float *out, int num_threads) {                                                    \
        const int64_t G = H / Hkv, W = Hkv * D; /* W: one slot's row, all KV heads */          \
        int failed = 0;                                                                        \
        _Pragma("omp parallel for num_threads(num_threads) schedule(dynamic, 1)")              \
        for (int64_t b = 0; b < B; b++) {                                                      \
            const int64_t n = seq_lens[b];                                                     \
            const int32_t *pages = block_tables + b * max_pages;                               \
            const float *restrict qb = q + b * H * D;                                          \
            float *buf = malloc(sizeof(float) * (H * n + 2 * H + W));                          \
            if (!buf) { failed = 1; continue; }                                                \
            float *restrict scores = buf, *restrict mx = buf + H * n;                          \
            float *restrict total = mx + H, *restrict tmp = total + H;                         \
            float *restrict acc = out + b * H * D;                                             \
            for (int64_t j = 0; j < H; j++) mx[j] = -INFINITY;                                 \
            const int64_t num_pages = (n + page_size - 1) / page_size;                         \
            for (int64_t p = 0, t0 = 0; p < num_pages; p++, t0 += page_size) {                 \
                const KV_T *page = k_cache + (int64_t)pages[p] * page_stride;                  \
                const int64_t rows = n - t0 < page_size ? n - t0 : page_size;                  \
                for (int64_t r = 0; r < rows; r++) {                                           \
                    const float *restrict kr = ROW(page + r * W, tmp, W);                      \
                    float *restrict st = scores + (t0 + r) * H;                                \
                    for (int64_t h = 0; h < Hkv; h++) {                                        \
                        const float *restrict kh = kr + h * D;                                 \
                        for (int64_t g = 0; g < G; g++) {                                      \
                            const float *restrict qj = qb + (h * G + g) * D;                   \
                            float dot = 0.0f;                                                  \
                            _Pragma("omp simd reduction(+ : dot)")                             \
                            for (int64_t d = 0; d < D; d++) dot += qj[d] * kh[d];              \
                            st[h * G + g] = dot * scale;                                       \
                        }                                                                      \
                    }                                                                          \
                    _Pragma("omp simd")                                                        \
                    for (int64_t j = 0; j < H; j++) mx[j] = st[j] > mx[j] ? st[j] : mx[j];     \
                }                                                                              \
            }                                                                                  \
            for (int64_t j = 0; j < H; j++) total[j] = 0.0f;                                   \
            for (int64_t t = 0; t < n; t++) {                                                  \
                float *restrict st = scores + t * H;                                           \
                _Pragma("omp simd")                                                            \
                for (int64_t j = 0; j < H; j++) {                                              \
                    const float e = exp_neg(st[j] - mx[j]);                                    \
                    st[j] = e;                                                                 \
                    total[j] += e;                                                             \
                }                                                                              \
            }                                                                                  \
            memset(acc, 0, sizeof(float) * H * D);                                             \
            for (int64_t p = 0, t0 = 0; p < num_pages; p++, t0 += page_size) {                 \
                const KV_T *page = v_cache + (int64_t)pages[p] * page_stride;                  \
                const int64_t rows = n - t0 < page_size ? n - t0 : page_size;                  \
                for (int64_t r = 0; r < rows; r++) {                                           \
                    const float *restrict vr = ROW(page + r * W, tmp, W);                      \
                    const float *restrict st = scores + (t0 + r) * H;                          \
                    for (int64_t h = 0; h < Hkv; h++) {                                        \
                        const float *restrict vh = vr + h * D;                                 \
                        for (int64_t g = 0; g < G; g++) {                                      \
                            const float pr = st[h * G + g];                                    \
                            float *restrict a = acc + (h * G + g) * D;                         \
                            _Pragma("omp simd")                                                \
                            for (int64_t d = 0; d < D; d++) a[d] += pr * vh[d];                \
                        }                                                                      \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
            for (int64_t j = 0; j < H; j++) {                                                  \
                const float inv = 1.0f / total[j];                                             \
                _Pragma("omp simd")                                                            \
                for (int64_t d = 0; d < D; d++) acc[j * D + d] *= inv;                         \
            }                                                                                  \
            free(buf);                                                                         \
        }                                                                                      \
        return failed;                                                                         \
    }

PAGED_DECODE(paged_decode_f32, float, row_f32)
PAGED_DECODE(paged_decode_bf16, uint16_t, row_bf16)
