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

static inline float load_f32(const float *p, int64_t i) { return p[i]; }

static inline float load_bf16(const uint16_t *p, int64_t i) {
    uint32_t u = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#define PAGED_DECODE(NAME, KV_T, LOAD)                                                         \
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
            const float *qb = q + b * H * D;                                                   \
            float *scores = malloc(sizeof(float) * (H * n + H + W));                           \
            if (!scores) { failed = 1; continue; }                                             \
            float *total = scores + H * n, *row = total + H, *acc = out + b * H * D;           \
            for (int64_t t = 0; t < n; t++) {                                                  \
                const KV_T *kr = k_cache + (int64_t)pages[t / page_size] * page_stride         \
                                 + (t % page_size) * W;                                        \
                _Pragma("omp simd")                                                            \
                for (int64_t i = 0; i < W; i++) row[i] = LOAD(kr, i);                          \
                for (int64_t j = 0; j < H; j++) {                                              \
                    const float *qj = qb + j * D, *kj = row + (j / G) * D;                     \
                    float dot = 0.0f;                                                          \
                    _Pragma("omp simd reduction(+ : dot)")                                     \
                    for (int64_t d = 0; d < D; d++) dot += qj[d] * kj[d];                      \
                    scores[j * n + t] = dot * scale;                                           \
                }                                                                              \
            }                                                                                  \
            for (int64_t j = 0; j < H; j++) {                                                  \
                float *s = scores + j * n, m = -INFINITY, sum = 0.0f;                          \
                for (int64_t t = 0; t < n; t++) m = s[t] > m ? s[t] : m;                       \
                _Pragma("omp simd reduction(+ : sum)")                                         \
                for (int64_t t = 0; t < n; t++) { s[t] = expf(s[t] - m); sum += s[t]; }        \
                total[j] = sum;                                                                \
            }                                                                                  \
            memset(acc, 0, sizeof(float) * H * D);                                             \
            for (int64_t t = 0; t < n; t++) {                                                  \
                const KV_T *vr = v_cache + (int64_t)pages[t / page_size] * page_stride         \
                                 + (t % page_size) * W;                                        \
                _Pragma("omp simd")                                                            \
                for (int64_t i = 0; i < W; i++) row[i] = LOAD(vr, i);                          \
                for (int64_t j = 0; j < H; j++) {                                              \
                    const float p = scores[j * n + t], *vj = row + (j / G) * D;                \
                    float *a = acc + j * D;                                                    \
                    _Pragma("omp simd")                                                        \
                    for (int64_t d = 0; d < D; d++) a[d] += p * vj[d];                         \
                }                                                                              \
            }                                                                                  \
            for (int64_t j = 0; j < H; j++) {                                                  \
                const float inv = 1.0f / total[j];                                             \
                for (int64_t d = 0; d < D; d++) acc[j * D + d] *= inv;                         \
            }                                                                                  \
            free(scores);                                                                      \
        }                                                                                      \
        return failed;                                                                         \
    }

PAGED_DECODE(paged_decode_f32, float, load_f32)
PAGED_DECODE(paged_decode_bf16, uint16_t, load_bf16)
