/* Paged decode attention for the CPU: one query token per sequence, reading each key and
 * value row once, straight from its page (no gathered copy of the context).
 *
 * Shapes: q and out float32 [B, H, D] (contiguous); k_cache, v_cache one layer's pages
 * [num_pages, page_size, Hkv, D] (float32 or bfloat16), each page's rows contiguous and
 * pages `page_stride` elements apart (the page-major pool interleaves every layer's K and
 * V between them); block_tables int32 [B, max_pages]; seq_lens int32 [B]. Position t of
 * sequence b is row t % page_size of page block_tables[b][t / page_size].
 * The H / Hkv query heads of one KV head share that head's keys (GQA without repeats).
 * One task is one sequence: its rows hold every KV head side by side, so reading them whole
 * keeps the reads sequential within a page. Exact softmax in two passes over the context,
 * in float32 (accumulating into `out`); `sinks` (NULL: none), one per query head, are one
 * more score each, with no value row (GPT-OSS). With AVX2 and FMA (any x86 of the last
 * decade) the dot products and the weighted sums use 256-bit intrinsics; elsewhere plain
 * loops the compiler vectorizes. bfloat16 pages of head_dim 64 use AVX512-BF16's vdpbf16ps
 * where the CPU has it: keys scored straight from the page (no conversion of K), values
 * summed two rows a lane with the weights rounded to bfloat16 (as torch's flash attention
 * does for bfloat16). Built and loaded by paged_decode.py; see there for why this exists.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../attention_tiles.h"
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

/* Starts loading the page after next while this page is computed on: a sequence's pages lie
 * anywhere in the pool, where the hardware prefetcher cannot guess them. Into L2, not L1
 * (locality 2, prefetcht1): prefetches into L1 hold the core's few L1 fill buffers until their
 * lines arrive, so the loads of the page being computed on wait behind them; measured, the 30
 * layers of a step at batch 32, 320 tokens each, took 20-21 ms against 30 fp32 and 15 against
 * 18 bf16. Issued in shares between the heads' work. Two pages ahead, not one, since the
 * bfloat16 weighted sums use vdpbf16ps: 11.5-12.3 against 12.4-13.7 ms bf16, fp32 the same. */
static inline void prefetch_rows(const void *start, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)start + off, 0, 2);
}

/* A page's first `count` values converted to float32 into tmp. */
static inline const float *block_bf16(const uint16_t *restrict src, float *restrict tmp, int64_t count) {
    uint32_t *restrict t = (uint32_t *)tmp;
#pragma omp simd
    for (int64_t i = 0; i < count; i++) t[i] = (uint32_t)src[i] << 16;
    return tmp;
}

#if defined(__AVX512BF16__)
#define HAVE_DPBF16 1
/* Lane i of the result is the sum of the sixteen lanes of a[4 * (i % 4) + i / 4]: four rounds
 * of pairwise shuffles and adds, not sixteen horizontal sums. */
static inline __m512 sum16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44), _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

/* score_rows for bfloat16 rows and query, head_dim 64: pairs of products summed in float32 by
 * vdpbf16ps straight from the page (no conversion), sixteen rows per sum16. */
static inline void score_rows_dp(const uint16_t *restrict q, const uint16_t *restrict blk, int64_t W, int64_t rows,
                                 float scale, float *restrict st) {
    const __m512bh q0 = (__m512bh)_mm512_loadu_si512(q), q1 = (__m512bh)_mm512_loadu_si512(q + 32);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t count = rows - r0 < 16 ? rows - r0 : 16;
        __m512 a[16];
        for (int r = 0; r < 16; r++) {
            __m512 x = _mm512_setzero_ps();
            if (r < count) {
                const uint16_t *k = blk + (r0 + r) * W;
                x = _mm512_dpbf16_ps(x, q0, (__m512bh)_mm512_loadu_si512(k));
                x = _mm512_dpbf16_ps(x, q1, (__m512bh)_mm512_loadu_si512(k + 32));
            }
            a[((r & 3) << 2) | (r >> 2)] = x; /* so that lane r of sum16 is row r */
        }
        _mm512_mask_storeu_ps(st + r0, (__mmask16)((1u << count) - 1u), _mm512_mul_ps(sum16(a), _mm512_set1_ps(scale)));
    }
}

/* add_rows for the G query heads of one KV head, bfloat16 rows, head_dim 64: each 16 rows'
 * weights rounded to bfloat16 (as torch's flash attention does for bfloat16) and summed in
 * float32 by vdpbf16ps, two rows a lane, from the rows interleaved in pairs once for all G
 * heads. p: the first head's weights (a head's n apart); acc: its outputs (D apart). */
static inline void add_rows_dp(float *restrict acc, const float *restrict p, int64_t n, int64_t G,
                               const uint16_t *restrict blk, int64_t W, int64_t rows, const char *next, int64_t chunk) {
    uint32_t vp[8 * 64] __attribute__((aligned(64))); /* row pairs' dimension d: (v[2i][d], v[2i+1][d]) */
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t count = rows - r0 < 16 ? rows - r0 : 16, pairs = (count + 1) / 2;
        pair_rows(blk + r0 * W, W, count, vp);
        for (int64_t g = 0; g < G; g++) {
            if (next) prefetch_rows(next + g * chunk, chunk);
            uint32_t pw[8] __attribute__((aligned(32)));
            const __m512 w = _mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1u), p + g * n + r0);
            _mm256_store_si256((__m256i *)pw, (__m256i)_mm512_cvtneps_pbh(w));
            float *o = acc + g * 64;
            __m512 o0 = _mm512_loadu_ps(o), o1 = _mm512_loadu_ps(o + 16), o2 = _mm512_loadu_ps(o + 32), o3 = _mm512_loadu_ps(o + 48);
            for (int64_t i = 0; i < pairs; i++) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pw[i]);
                o0 = _mm512_dpbf16_ps(o0, x, (__m512bh)_mm512_load_si512(vp + i * 64));
                o1 = _mm512_dpbf16_ps(o1, x, (__m512bh)_mm512_load_si512(vp + i * 64 + 16));
                o2 = _mm512_dpbf16_ps(o2, x, (__m512bh)_mm512_load_si512(vp + i * 64 + 32));
                o3 = _mm512_dpbf16_ps(o3, x, (__m512bh)_mm512_load_si512(vp + i * 64 + 48));
            }
            _mm512_storeu_ps(o, o0); _mm512_storeu_ps(o + 16, o1); _mm512_storeu_ps(o + 32, o2); _mm512_storeu_ps(o + 48, o3);
        }
    }
}
#endif

/* Scores of one page's `rows` rows for all H query heads into sc[j * n + r] (sc: the page's
 * first position), prefetching a later page a head's share at a time. q: float32 [H][D];
 * qh: the same as bfloat16 (bfloat16 pages only). */
static inline void score_page_f32(const float *q, const uint16_t *qh, const float *page, float *tmp, int64_t rows,
                                  int64_t H, int64_t Hkv, int64_t D, int64_t n, float scale, float *sc,
                                  const char *next, int64_t chunk) {
    (void)qh; (void)tmp;
    const int64_t G = H / Hkv, W = Hkv * D;
    for (int64_t j = 0; j < H; j++) {
        if (next) prefetch_rows(next + j * chunk, chunk);
        score_rows(q + j * D, page + (j / G) * D, W, rows, D, scale, sc + j * n);
    }
}

static inline void score_page_bf16(const float *q, const uint16_t *qh, const uint16_t *page, float *tmp, int64_t rows,
                                   int64_t H, int64_t Hkv, int64_t D, int64_t n, float scale, float *sc,
                                   const char *next, int64_t chunk) {
#ifdef HAVE_DPBF16
    if (D == 64) {
        const int64_t G = H / Hkv, W = Hkv * D;
        for (int64_t j = 0; j < H; j++) {
            if (next) prefetch_rows(next + j * chunk, chunk);
            score_rows_dp(qh + j * D, page + (j / G) * D, W, rows, scale, sc + j * n);
        }
        return;
    }
#endif
    (void)qh;
    score_page_f32(q, NULL, block_bf16(page, tmp, rows * Hkv * D), tmp, rows, H, Hkv, D, n, scale, sc, next, chunk);
}

/* Pass 2 for one page: every V row into the H outputs (acc [H][D]; p: the page's first
 * weight of head 0, a head's n apart), prefetching a later page a head's share at a time. */
static inline void add_page_f32(float *acc, const float *p, int64_t n, const float *page, float *tmp, int64_t rows,
                                int64_t H, int64_t Hkv, int64_t D, const char *next, int64_t chunk) {
    (void)tmp;
    const int64_t G = H / Hkv, W = Hkv * D;
    for (int64_t j = 0; j < H; j++) {
        if (next) prefetch_rows(next + j * chunk, chunk);
        add_rows(acc + j * D, p + j * n, page + (j / G) * D, W, rows, D);
    }
}

static inline void add_page_bf16(float *acc, const float *p, int64_t n, const uint16_t *page, float *tmp, int64_t rows,
                                 int64_t H, int64_t Hkv, int64_t D, const char *next, int64_t chunk) {
#ifdef HAVE_DPBF16
    if (D == 64) {
        const int64_t G = H / Hkv, W = Hkv * D;
        for (int64_t h = 0; h < Hkv; h++)
            add_rows_dp(acc + h * G * D, p + h * G * n, n, G, page + h * D, W, rows, next ? next + h * G * chunk : NULL, chunk);
        return;
    }
#endif
    add_page_f32(acc, p, n, block_bf16(page, tmp, rows * Hkv * D), tmp, rows, H, Hkv, D, next, chunk);
}

/* Per sequence: pass 1 scores every K row of a page for the G query heads of each KV head
 * (scores stored [H][n], eight rows per horizontal sum); then max, exp and sums per head,
 * vectorized over positions; pass 2 adds every V row into all H outputs, 64 dimensions of
 * one head held in registers across a page's rows. Pages are walked in order, each one
 * read from L1 by every head: converted once (bfloat16), or with vdpbf16ps K read in place
 * and V interleaved in row pairs once per KV head.
 * The prefetch two pages ahead runs on past each pass's end: pass 1's last two pages fetch
 * pass 2's first two V pages, and pass 2's last two the first two K pages of the thread's
 * next sequence, which it claims (a shared counter, in order) when it starts this one. Left
 * to start cold, those four pages of each sequence waited on memory: 30 layers at batch 64,
 * 160 tokens each, took 20.0-20.7 ms against 23.6-24.3; at 448 tokens 53.7-55.4 against
 * 57.3-57.5; bfloat16 at batch 32, 320 tokens, 10.5-15.0 against 11.7-17.2. */
#define PAGED_DECODE(NAME, KV_T, SCORE, ADD)                                                   \
    int NAME(const float *q, const KV_T *k_cache, const KV_T *v_cache,                         \
             const int32_t *block_tables, int64_t max_pages, const int32_t *seq_lens,          \
             int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t page_size,                 \
             int64_t page_stride, float scale, int64_t window, float softcap,                  \
             const float *sinks, float *out, int num_threads) {                                \
        const int64_t W = Hkv * D; /* W: one slot's row, all KV heads */                      \
        /* the page after next is prefetched a head's share at a time, between the heads' work */ \
        const int64_t chunk = (int64_t)(sizeof(KV_T) * page_size * W + H - 1) / H;            \
        int failed = 0;                                                                        \
        int64_t claimed = 0; /* sequences handed out so far */                                 \
        _Pragma("omp parallel num_threads(num_threads)")                                       \
        {                                                                                      \
        int64_t b = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);                         \
        for (int64_t after; b < B; b = after) {                                                \
            after = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED); /* this thread's next */ \
            const int64_t n = seq_lens[b];                                                     \
            const int32_t *pages = block_tables + b * max_pages;                               \
            const float *restrict qb = q + b * H * D;                                          \
            float *buf = malloc(sizeof(float) * (H * n + H + page_size * W + H * D));          \
            if (!buf) { failed = 1; continue; }                                                \
            float *restrict scores = buf, *restrict total = buf + H * n;                       \
            float *restrict tmp = total + H;                                                   \
            uint16_t *restrict qh = (uint16_t *)(tmp + page_size * W); /* q as bfloat16 */     \
            if (sizeof(KV_T) == 2)                                                             \
                for (int64_t i = 0; i < H * D; i++) qh[i] = bf16_bits(qb[i]);                  \
            float *restrict acc = out + b * H * D;                                             \
            const int64_t num_pages = (n + page_size - 1) / page_size;                         \
            /* A sliding window: positions [lo, n) only; pages wholly before it are skipped, */ \
            /* the rest of lo's page weighs 0. */                                              \
            const int64_t lo = window > 0 && n > window ? n - window : 0, p0 = lo / page_size; \
            for (int64_t p = p0, t0 = p0 * page_size; p < num_pages; p++, t0 += page_size) {   \
                const int64_t rows = n - t0 < page_size ? n - t0 : page_size;                  \
                const char *next = p + 2 < num_pages                                           \
                    ? (const char *)(k_cache + (int64_t)pages[p + 2] * page_stride)             \
                    : p + 2 - num_pages < num_pages                                            \
                    ? (const char *)(v_cache + (int64_t)pages[p + 2 - num_pages] * page_stride) : NULL; \
                SCORE(qb, qh, k_cache + (int64_t)pages[p] * page_stride, tmp, rows, H, Hkv, D, n,    \
                      scale, scores + t0, next, chunk);                                        \
            }                                                                                  \
            for (int64_t j = 0; j < H; j++) {                                                  \
                float *restrict st = scores + j * n;                                           \
                float m = sinks ? sinks[j] : -INFINITY, sum = 0.0f;                            \
                if (softcap > 0.0f) /* Gemma 2: scores capped, cap * tanh(score / cap) */       \
                    for (int64_t t = lo; t < n; t++) st[t] = softcap * tanhf(st[t] / softcap);  \
                _Pragma("omp simd reduction(max : m)")                                         \
                for (int64_t t = lo; t < n; t++) m = st[t] > m ? st[t] : m;                    \
                _Pragma("omp simd reduction(+ : sum)")                                         \
                for (int64_t t = lo; t < n; t++) {                                             \
                    const float e = fast_exp(st[t] - m);                                        \
                    st[t] = e;                                                                 \
                    sum += e;                                                                  \
                }                                                                              \
                for (int64_t t = p0 * page_size; t < lo; t++) st[t] = 0.0f;                   \
                total[j] = sinks ? sum + fast_exp(sinks[j] - m) : sum;                         \
            }                                                                                  \
            memset(acc, 0, sizeof(float) * H * D);                                             \
            for (int64_t p = p0, t0 = p0 * page_size; p < num_pages; p++, t0 += page_size) {   \
                const int64_t rows = n - t0 < page_size ? n - t0 : page_size;                  \
                const int64_t ahead = p + 2 - num_pages;                                       \
                const char *next = p + 2 < num_pages                                           \
                    ? (const char *)(v_cache + (int64_t)pages[p + 2] * page_stride)             \
                    : after < B && ahead * page_size < seq_lens[after]                         \
                    ? (const char *)(k_cache + (int64_t)block_tables[after * max_pages + ahead] * page_stride) : NULL; \
                ADD(acc, scores + t0, n, v_cache + (int64_t)pages[p] * page_stride, tmp, rows, H, Hkv, D, \
                    next, chunk);                                                              \
            }                                                                                  \
            for (int64_t j = 0; j < H; j++) {                                                  \
                const float inv = 1.0f / total[j];                                             \
                _Pragma("omp simd")                                                            \
                for (int64_t d = 0; d < D; d++) acc[j * D + d] *= inv;                         \
            }                                                                                  \
            free(buf);                                                                         \
        }                                                                                      \
        }                                                                                      \
        return failed;                                                                         \
    }

PAGED_DECODE(paged_decode_f32, float, score_page_f32, add_page_f32)
PAGED_DECODE(paged_decode_bf16, uint16_t, score_page_bf16, add_page_bf16)
