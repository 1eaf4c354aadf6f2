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
 * context, in float32 (accumulating into `out`). With AVX2 and FMA (any x86 of the last
 * decade) the dot products and the weighted sums use 256-bit intrinsics; elsewhere plain
 * loops the compiler vectorizes. Built and loaded by paged_decode.py;
 * see there for why this exists.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../fast_exp.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1

/* The sums of eight vectors, one per lane. */
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                           __m256 a7) {
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
#endif

/* st[r] = (q . k_r) * scale for the `rows` rows k_r = blk + r * W (D floats each). Eight rows
 * at a time with one accumulator each, reduced together: one horizontal sum per eight dots. */
static inline void score_rows(const float *restrict q, const float *restrict blk, int64_t W, int64_t rows,
                              int64_t D, float scale, float *restrict st) {
    int64_t r = 0;
#ifdef HAVE_AVX2
    if (D % 8 == 0) {
        for (; r + 8 <= rows; r += 8) {
            const float *k = blk + r * W;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(q + d);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + d), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + W + d), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * W + d), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * W + d), a3);
                a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 4 * W + d), a4);
                a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 5 * W + d), a5);
                a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 6 * W + d), a6);
                a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 7 * W + d), a7);
            }
            _mm256_storeu_ps(st + r, _mm256_mul_ps(hsum8(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_set1_ps(scale)));
        }
    }
#endif
    for (; r < rows; r++) {
        const float *restrict k = blk + r * W;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; d++) dot += q[d] * k[d];
        st[r] = dot * scale;
    }
}

/* acc[d] += sum_r p[r] * v_r[d] for the `rows` rows v_r = blk + r * W: 64 dimensions at a time
 * held in registers over all rows. */
static inline void add_rows(float *restrict acc, const float *restrict p, const float *restrict blk, int64_t W,
                            int64_t rows, int64_t D) {
    int64_t d0 = 0;
#ifdef HAVE_AVX2
    for (; d0 + 64 <= D; d0 += 64) {
        __m256 c0 = _mm256_loadu_ps(acc + d0), c1 = _mm256_loadu_ps(acc + d0 + 8);
        __m256 c2 = _mm256_loadu_ps(acc + d0 + 16), c3 = _mm256_loadu_ps(acc + d0 + 24);
        __m256 c4 = _mm256_loadu_ps(acc + d0 + 32), c5 = _mm256_loadu_ps(acc + d0 + 40);
        __m256 c6 = _mm256_loadu_ps(acc + d0 + 48), c7 = _mm256_loadu_ps(acc + d0 + 56);
        for (int64_t r = 0; r < rows; r++) {
            const __m256 pr = _mm256_set1_ps(p[r]);
            const float *v = blk + r * W + d0;
            c0 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v), c0);
            c1 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + 8), c1);
            c2 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + 16), c2);
            c3 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + 24), c3);
            c4 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + 32), c4);
            c5 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + 40), c5);
            c6 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + 48), c6);
            c7 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + 56), c7);
        }
        _mm256_storeu_ps(acc + d0, c0); _mm256_storeu_ps(acc + d0 + 8, c1);
        _mm256_storeu_ps(acc + d0 + 16, c2); _mm256_storeu_ps(acc + d0 + 24, c3);
        _mm256_storeu_ps(acc + d0 + 32, c4); _mm256_storeu_ps(acc + d0 + 40, c5);
        _mm256_storeu_ps(acc + d0 + 48, c6); _mm256_storeu_ps(acc + d0 + 56, c7);
    }
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float pr = p[r];
        const float *restrict v = blk + r * W;
#pragma omp simd
        for (int64_t d = d0; d < D; d++) acc[d] += pr * v[d];
    }
}

/* Starts loading the next page's rows while this page is computed on: a sequence's pages lie
 * anywhere in the pool, where the hardware prefetcher cannot guess them. Issued in shares
 * between the heads' work: a whole page's lines at once stall on the core's few fill buffers. */
static inline void prefetch_rows(const void *start, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)start + off, 0, 3);
}

/* A page's first `count` values as float32: the page itself, or converted into tmp. */
static inline const float *block_f32(const float *src, float *restrict tmp, int64_t count) {
    (void)tmp; (void)count;
    return src;
}

static inline const float *block_bf16(const uint16_t *restrict src, float *restrict tmp, int64_t count) {
    uint32_t *restrict t = (uint32_t *)tmp;
#pragma omp simd
    for (int64_t i = 0; i < count; i++) t[i] = (uint32_t)src[i] << 16;
    return tmp;
}

/* Per sequence: pass 1 scores every K row of a page for the G query heads of each KV head
 * (scores stored [H][n], eight rows per horizontal sum); then max, exp and sums per head,
 * vectorized over positions; pass 2 adds every V row into all H outputs, 64 dimensions of
 * one head held in registers across a page's rows. Pages are walked in order, each one
 * converted once (bfloat16) and read from L1 by every head. */
#define PAGED_DECODE(NAME, KV_T, BLOCK)                                                        \
    int NAME(const float *q, const KV_T *k_cache, const KV_T *v_cache,                         \
             const int32_t *block_tables, int64_t max_pages, const int32_t *seq_lens,          \
             int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t page_size,                 \
             int64_t page_stride, float scale,                                                 \
             float *out, int num_threads) {                                                    \
        const int64_t G = H / Hkv, W = Hkv * D; /* W: one slot's row, all KV heads */          \
        /* the next page is prefetched a head's share at a time, between the heads' work */    \
        const int64_t chunk = (int64_t)(sizeof(KV_T) * page_size * W + H - 1) / H;            \
        int failed = 0;                                                                        \
        _Pragma("omp parallel for num_threads(num_threads) schedule(dynamic, 1)")              \
        for (int64_t b = 0; b < B; b++) {                                                      \
            const int64_t n = seq_lens[b];                                                     \
            const int32_t *pages = block_tables + b * max_pages;                               \
            const float *restrict qb = q + b * H * D;                                          \
            float *buf = malloc(sizeof(float) * (H * n + H + page_size * W));                  \
            if (!buf) { failed = 1; continue; }                                                \
            float *restrict scores = buf, *restrict total = buf + H * n;                       \
            float *restrict tmp = total + H;                                                   \
            float *restrict acc = out + b * H * D;                                             \
            const int64_t num_pages = (n + page_size - 1) / page_size;                         \
            for (int64_t p = 0, t0 = 0; p < num_pages; p++, t0 += page_size) {                 \
                const int64_t rows = n - t0 < page_size ? n - t0 : page_size;                  \
                const char *next = p + 1 < num_pages                                           \
                    ? (const char *)(k_cache + (int64_t)pages[p + 1] * page_stride) : NULL;     \
                const float *blk = BLOCK(k_cache + (int64_t)pages[p] * page_stride, tmp, rows * W); \
                for (int64_t h = 0; h < Hkv; h++)                                              \
                    for (int64_t g = 0; g < G; g++) {                                          \
                        const int64_t j = h * G + g;                                           \
                        if (next) prefetch_rows(next + j * chunk, chunk);                      \
                        score_rows(qb + j * D, blk + h * D, W, rows, D, scale, scores + j * n + t0); \
                    }                                                                          \
            }                                                                                  \
            for (int64_t j = 0; j < H; j++) {                                                  \
                float *restrict st = scores + j * n;                                           \
                float m = -INFINITY, sum = 0.0f;                                               \
                _Pragma("omp simd reduction(max : m)")                                         \
                for (int64_t t = 0; t < n; t++) m = st[t] > m ? st[t] : m;                     \
                _Pragma("omp simd reduction(+ : sum)")                                         \
                for (int64_t t = 0; t < n; t++) {                                              \
                    const float e = fast_exp(st[t] - m);                                        \
                    st[t] = e;                                                                 \
                    sum += e;                                                                  \
                }                                                                              \
                total[j] = sum;                                                                \
            }                                                                                  \
            memset(acc, 0, sizeof(float) * H * D);                                             \
            for (int64_t p = 0, t0 = 0; p < num_pages; p++, t0 += page_size) {                 \
                const int64_t rows = n - t0 < page_size ? n - t0 : page_size;                  \
                const char *next = p + 1 < num_pages                                           \
                    ? (const char *)(v_cache + (int64_t)pages[p + 1] * page_stride) : NULL;     \
                const float *blk = BLOCK(v_cache + (int64_t)pages[p] * page_stride, tmp, rows * W); \
                for (int64_t h = 0; h < Hkv; h++)                                              \
                    for (int64_t g = 0; g < G; g++) {                                          \
                        const int64_t j = h * G + g;                                           \
                        if (next) prefetch_rows(next + j * chunk, chunk);                      \
                        add_rows(acc + j * D, scores + j * n + t0, blk + h * D, W, rows, D);   \
                    }                                                                          \
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

PAGED_DECODE(paged_decode_f32, float, block_f32)
PAGED_DECODE(paged_decode_bf16, uint16_t, block_bf16)
