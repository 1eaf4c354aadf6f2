/* Prefill attention for the CPU: the new tokens of one sequence (its chunk of queries,
 * causal) over every K/V row of its context, read straight from the pages (no gathered copy).
 *
 * Shapes: q and out float32 [n, H, D] (contiguous); k_cache, v_cache one layer's pages
 * [num_pages, page_size, Hkv, D] (float32 or bfloat16), each page's rows contiguous and pages
 * `page_stride` elements apart; pages int32 [ceil(ctx / page_size)]. Query row i is position
 * ctx - n + i and sees positions 0..ctx - n + i (a cached prefix, then causal).
 * One task is one KV head and QB query positions, for all G query heads that share the head
 * (GQA without repeats), so each page is converted (bfloat16), transposed (K) and read from
 * L1 by G * QB query vectors. Online softmax in float32, one pass over the pages; pages past
 * the task's last position are never read. With AVX-512 (D = 64, pages of 16) a page's K is
 * transposed in registers, four query vectors are scored against it at once (16 rows in a
 * register) and their weighted V sums held in registers; each query's max moves only when a
 * score passes it by more than TAU, so most pages need no horizontal max and no rescaling,
 * and its sum stays 16 lanes wide until the end. bfloat16 pages with AVX512-BF16 are
 * scored and summed by vdpbf16ps (K as pairs of dimensions, V rows in pairs, the weights
 * rounded to bfloat16 as torch's flash attention does). With AVX2 and FMA only, the same
 * page-at-a-time plan on 8-lane registers (float32; bfloat16 pages converted). Elsewhere
 * plain loops the compiler vectorizes. Tasks run longest first (the last positions see the
 * most context). Built and loaded by prefill_attention.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "../attention_tiles.h"
#include "../fast_exp.h"

#define QB 32 /* query positions per task */

static inline void load_bf16(float *restrict dst, const uint16_t *restrict src, int64_t count) {
    uint32_t *restrict t = (uint32_t *)dst;
#pragma omp simd
    for (int64_t i = 0; i < count; i++) t[i] = (uint32_t)src[i] << 16;
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define TAU 8.0f /* scores may exceed the reference max by this before it moves (weights <= e^8) */

/* Four query vectors (D = 64) against one page of 16 rows. Scores: float32, qs (scaled) rows
 * against kt [64][16]; or, when qp is set, bfloat16 pairs of the query (unscaled) against kt
 * holding the page's pairs [32][16] (vdpbf16ps: two products a lane, summed in float32).
 * vb rows [16][64] `vs` floats apart. mx: each query's reference max, moved only when a score
 * passes it by more than TAU (then the sums and accumulators are rescaled), so most pages
 * need no horizontal max; tot: each query's 16 lanes of partial sums. */
static inline void page4(const float *restrict qs, const uint32_t *restrict qp, float scale, const float *restrict kt,
                         const float *restrict vb, int64_t vs, const __mmask16 *mask, float *restrict mx,
                         float *restrict tot, float *restrict acc, int c) {
    (void)qp, (void)scale; /* without AVX512-BF16 */
    __m512 s[4], u[4]; /* even and odd dimensions: eight chains, not four */
    for (int k = 0; k < 4; k++) s[k] = u[k] = _mm512_setzero_ps();
#ifdef __AVX512BF16__
    if (qp) {
        for (int j = 0; j < 32; j += 2) {
            const __m512bh kd = (__m512bh)_mm512_load_si512(kt + j * 16), ke = (__m512bh)_mm512_load_si512(kt + j * 16 + 16);
            for (int k = 0; k < 4; k++) {
                s[k] = _mm512_dpbf16_ps(s[k], (__m512bh)_mm512_set1_epi32((int)qp[k * 32 + j]), kd);
                u[k] = _mm512_dpbf16_ps(u[k], (__m512bh)_mm512_set1_epi32((int)qp[k * 32 + j + 1]), ke);
            }
        }
        for (int k = 0; k < 4; k++) s[k] = _mm512_mul_ps(_mm512_add_ps(s[k], u[k]), _mm512_set1_ps(scale));
    } else
#endif
    {
        for (int d = 0; d < 64; d += 2) {
            const __m512 kd = _mm512_load_ps(kt + d * 16), ke = _mm512_load_ps(kt + d * 16 + 16);
            for (int k = 0; k < 4; k++) {
                s[k] = _mm512_fmadd_ps(_mm512_set1_ps(qs[k * 64 + d]), kd, s[k]);
                u[k] = _mm512_fmadd_ps(_mm512_set1_ps(qs[k * 64 + d + 1]), ke, u[k]);
            }
        }
        for (int k = 0; k < 4; k++) s[k] = _mm512_add_ps(s[k], u[k]);
    }
    float pw[4][16] __attribute__((aligned(64)));
    float alpha[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    for (int k = 0; k < 4; k++) {
        if (k >= c || !mask[k]) { _mm512_store_ps(pw[k], _mm512_setzero_ps()); continue; }
        if (_mm512_mask_cmp_ps_mask(mask[k], s[k], _mm512_set1_ps(mx[k] + TAU), _CMP_GT_OQ)) {
            const float m = _mm512_mask_reduce_max_ps(mask[k], s[k]);
            alpha[k] = mx[k] == -INFINITY ? 0.0f : _mm512_cvtss_f32(exp16s(_mm512_set1_ps(mx[k] - m)));
            mx[k] = m;
            _mm512_store_ps(tot + k * 16, _mm512_mul_ps(_mm512_load_ps(tot + k * 16), _mm512_set1_ps(alpha[k])));
        }
        const __m512 p = _mm512_maskz_mov_ps(mask[k], exp16s(_mm512_sub_ps(s[k], _mm512_set1_ps(mx[k]))));
        _mm512_store_ps(tot + k * 16, _mm512_add_ps(_mm512_load_ps(tot + k * 16), p));
        _mm512_store_ps(pw[k], p);
    }
    __m512 o[4][4];
    for (int k = 0; k < 4; k++) {
        for (int j = 0; j < 4; j++) o[k][j] = _mm512_loadu_ps(acc + k * 64 + j * 16);
        if (alpha[k] != 1.0f)
            for (int j = 0; j < 4; j++) o[k][j] = _mm512_mul_ps(o[k][j], _mm512_set1_ps(alpha[k]));
    }
#ifdef __AVX512BF16__
    if (qp) { /* vb: the rows in pairs; the weights rounded to bfloat16, as torch's flash attention does */
        uint32_t pp[4][8] __attribute__((aligned(32)));
        for (int k = 0; k < 4; k++) _mm256_store_si256((__m256i *)pp[k], (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(pw[k])));
        for (int i = 0; i < 8; i++) {
            __m512i v0 = _mm512_load_si512(vb + i * 64), v1 = _mm512_load_si512(vb + i * 64 + 16);
            __m512i v2 = _mm512_load_si512(vb + i * 64 + 32), v3 = _mm512_load_si512(vb + i * 64 + 48);
            __asm__("" : "+v"(v0), "+v"(v1), "+v"(v2), "+v"(v3));
            for (int k = 0; k < 4; k++) {
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[k][i]);
                o[k][0] = _mm512_dpbf16_ps(o[k][0], w, (__m512bh)v0);
                o[k][1] = _mm512_dpbf16_ps(o[k][1], w, (__m512bh)v1);
                o[k][2] = _mm512_dpbf16_ps(o[k][2], w, (__m512bh)v2);
                o[k][3] = _mm512_dpbf16_ps(o[k][3], w, (__m512bh)v3);
            }
        }
    } else
#endif
    for (int r = 0; r < 16; r++) {
        __m512 v0 = _mm512_loadu_ps(vb + r * vs), v1 = _mm512_loadu_ps(vb + r * vs + 16);
        __m512 v2 = _mm512_loadu_ps(vb + r * vs + 32), v3 = _mm512_loadu_ps(vb + r * vs + 48);
        /* Held in registers: left alone, the compiler folds each row's loads into all 16 FMAs
         * (four times the loads) and the weights into registers instead. */
        __asm__("" : "+v"(v0), "+v"(v1), "+v"(v2), "+v"(v3));
        for (int k = 0; k < 4; k++) {
            const __m512 w = _mm512_set1_ps(pw[k][r]);
            o[k][0] = _mm512_fmadd_ps(w, v0, o[k][0]);
            o[k][1] = _mm512_fmadd_ps(w, v1, o[k][1]);
            o[k][2] = _mm512_fmadd_ps(w, v2, o[k][2]);
            o[k][3] = _mm512_fmadd_ps(w, v3, o[k][3]);
        }
    }
    for (int k = 0; k < 4; k++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + k * 64 + j * 16, o[k][j]);
}

typedef __mmask16 page_mask;
static inline float sum16(const float *x) { return _mm512_reduce_add_ps(_mm512_load_ps(x)); }
#define HAVE_FAST 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TAU 8.0f
typedef uint32_t page_mask;

/* page4 with AVX2 (16 registers of 8 floats), float32 only (bfloat16 pages come converted):
 * scores as two registers a query (8 sums), then the weighted V rows a quarter of D (16
 * dimensions) at a time for all four queries (8 sums, 2 rows, 1 weight in registers). */
static inline void page4(const float *restrict qs, const uint32_t *restrict qp, float scale, const float *restrict kt,
                         const float *restrict vb, int64_t vs, const page_mask *mask, float *restrict mx,
                         float *restrict tot, float *restrict acc, int c) {
    (void)qp, (void)scale;
    __m256 s[4][2];
    for (int k = 0; k < 4; k++) s[k][0] = s[k][1] = _mm256_setzero_ps();
    for (int d = 0; d < 64; d++) {
        __m256 k0 = _mm256_load_ps(kt + d * 16), k1 = _mm256_load_ps(kt + d * 16 + 8);
        __asm__("" : "+x"(k0), "+x"(k1)); /* in registers, not loaded again for each query */
        for (int k = 0; k < 4; k++) {
            const __m256 x = _mm256_broadcast_ss(qs + k * 64 + d);
            s[k][0] = _mm256_fmadd_ps(x, k0, s[k][0]);
            s[k][1] = _mm256_fmadd_ps(x, k1, s[k][1]);
        }
    }
    /* The scores through memory, with constant indices: the softmax below indexes them at run
     * time, which had kept all eight sums on the stack, stored on every step of the loop above. */
    float sc[4][16] __attribute__((aligned(32)));
    _Pragma("GCC unroll 4") for (int k = 0; k < 4; k++) {
        _mm256_store_ps(sc[k], s[k][0]);
        _mm256_store_ps(sc[k] + 8, s[k][1]);
    }
    float pw[4][16] __attribute__((aligned(32)));
    float alpha[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int k = 0; k < 4; k++) {
        const int valid = k < c ? __builtin_popcount(mask[k]) : 0; /* a prefix of the page's rows */
        __m256 m[2], p[2];
        for (int h = 0; h < 2; h++)
            m[h] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid - 8 * h), lane));
        const __m256 bar = _mm256_set1_ps(mx[k] + TAU);
        const __m256 s0 = _mm256_load_ps(sc[k]), s1 = _mm256_load_ps(sc[k] + 8);
        const __m256 over = _mm256_or_ps(_mm256_and_ps(_mm256_cmp_ps(s0, bar, _CMP_GT_OQ), m[0]),
                                         _mm256_and_ps(_mm256_cmp_ps(s1, bar, _CMP_GT_OQ), m[1]));
        if (_mm256_movemask_ps(over)) {
            float mnew = -INFINITY;
            for (int r = 0; r < valid; r++) mnew = sc[k][r] > mnew ? sc[k][r] : mnew;
            alpha[k] = mx[k] == -INFINITY ? 0.0f : fast_exp(mx[k] - mnew);
            mx[k] = mnew;
            for (int r = 0; r < 16; r++) tot[k * 16 + r] *= alpha[k];
        }
        for (int h = 0; h < 2; h++) {
            p[h] = _mm256_and_ps(exp8s(_mm256_sub_ps(h ? s1 : s0, _mm256_set1_ps(mx[k]))), m[h]);
            _mm256_storeu_ps(tot + k * 16 + 8 * h, _mm256_add_ps(_mm256_loadu_ps(tot + k * 16 + 8 * h), p[h]));
            _mm256_store_ps(pw[k] + 8 * h, p[h]);
        }
    }
    for (int quarter = 0; quarter < 64; quarter += 16) {
        __m256 o[4][2];
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < 2; j++)
                o[k][j] = _mm256_mul_ps(_mm256_loadu_ps(acc + k * 64 + quarter + 8 * j), _mm256_set1_ps(alpha[k]));
        for (int r = 0; r < 16; r++) {
            __m256 v0 = _mm256_loadu_ps(vb + r * vs + quarter), v1 = _mm256_loadu_ps(vb + r * vs + quarter + 8);
            __asm__("" : "+x"(v0), "+x"(v1));
            for (int k = 0; k < 4; k++) {
                const __m256 w = _mm256_broadcast_ss(pw[k] + r);
                o[k][0] = _mm256_fmadd_ps(w, v0, o[k][0]);
                o[k][1] = _mm256_fmadd_ps(w, v1, o[k][1]);
            }
        }
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < 2; j++) _mm256_storeu_ps(acc + k * 64 + quarter + 8 * j, o[k][j]);
    }
}
static inline float sum16(const float *x) {
    float t = 0.0f;
    for (int r = 0; r < 16; r++) t += x[r];
    return t;
}
#define HAVE_FAST 1
#endif

/* One task: KV head h, query rows [i0, i0 + nq) of all G heads sharing it. */
static inline __attribute__((always_inline)) void block(
    const float *restrict q, const void *k_cache, const void *v_cache, int bf16, const int32_t *pages,
    int64_t n, int64_t ctx, int64_t H, int64_t Hkv, const int64_t D, const int64_t PS, int64_t page_stride,
    float scale, float *restrict out, int64_t h, int64_t i0, int64_t nq, float *restrict work) {
    const int64_t G = H / Hkv, W = Hkv * D, NV = G * QB;
    float *restrict kt = work;               /* [D][PS] */
    float *restrict vb = kt + D * PS;        /* [PS][D] */
    float *restrict s = vb + PS * D;         /* [NV][PS] */
    float *restrict acc = s + NV * PS;       /* [NV][D] */
    float *restrict mx = acc + NV * D, *restrict tot = mx + NV;
    float *restrict qs = tot + NV;           /* [NV][D], scaled */
    float *restrict row = qs + NV * D;       /* [PS * D] staging (bfloat16) */
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < nq; i++) {
            const float *src = q + (i0 + i) * H * D + (h * G + g) * D;
            float *dst = qs + (g * QB + i) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = src[d] * scale;
        }
    for (int64_t v = 0; v < NV; v++) { mx[v] = -INFINITY; tot[v] = 0.0f; }
    memset(acc, 0, sizeof(float) * NV * D);
    const int64_t first = ctx - n + i0;             /* absolute position of query row 0 */
    const int64_t last = first + nq - 1;
    const int64_t num_pages = last / PS + 1;
#ifdef HAVE_FAST
    if (D == 64 && PS == 16) {
        float *restrict totv = row + PS * D; /* [NV][16] partial sums */
        uint32_t *restrict qp = (uint32_t *)(totv + NV * 16); /* [NV][32] bfloat16 pairs (bfloat16 pages) */
        memset(totv, 0, sizeof(float) * NV * 16);
#ifdef __AVX512BF16__
        const int dp = bf16;
#else
        const int dp = 0;
#endif
        if (dp)
            for (int64_t g = 0; g < G; g++)
                for (int64_t i = 0; i < nq; i++) {
                    const float *src = q + (i0 + i) * H * D + (h * G + g) * D;
                    for (int64_t j = 0; j < 32; j++)
                        qp[(g * QB + i) * 32 + j] = bf16_bits(src[2 * j]) | (uint32_t)bf16_bits(src[2 * j + 1]) << 16;
                }
        for (int64_t p = 0; p < num_pages; p++) {
            const int64_t t0 = p * PS, rows = ctx - t0 < PS ? ctx - t0 : PS;
            const int64_t off = (int64_t)pages[p] * page_stride + h * D;
            if (dp) /* the page's bfloat16 pairs, as 32-bit words */
                for (int b = 0; b < 2; b++) transpose16((const float *)((const uint16_t *)k_cache + off) + b * 16, W / 2, rows, kt + b * 256);
            else {
                const float *kr = (const float *)k_cache + off;
                if (bf16) { /* converted first */
                    for (int64_t r = 0; r < rows; r++) load_bf16(row + r * D, (const uint16_t *)k_cache + off + r * W, D);
                    kr = row;
                }
                for (int b = 0; b < 4; b++) transpose16(kr + b * 16, bf16 ? D : W, rows, kt + b * 256);
            }
            const float *vrows = (const float *)v_cache + off;
            int64_t vs = W;
#ifdef __AVX512BF16__
            if (dp) {
                pair_rows((const uint16_t *)v_cache + off, W, rows, vb);
                vrows = vb;
            } else
#endif
            if (bf16 || rows < PS) { /* converted, or a partial page padded with zeros */
                for (int64_t r = 0; r < PS; r++) {
                    if (r >= rows) memset(vb + r * D, 0, sizeof(float) * D);
                    else if (bf16) load_bf16(vb + r * D, (const uint16_t *)v_cache + off + r * W, D);
                    else memcpy(vb + r * D, vrows + r * W, sizeof(float) * D);
                }
                vrows = vb;
                vs = D;
            }
            for (int64_t g = 0; g < G; g++)
                for (int64_t i = 0; i < nq; i += 4) {
                    const int c = nq - i < 4 ? (int)(nq - i) : 4;
                    page_mask mask[4];
                    for (int k = 0; k < 4; k++) {
                        int64_t valid = k < c ? first + i + k - t0 + 1 : 0;
                        valid = valid < 0 ? 0 : (valid > rows ? rows : valid);
                        mask[k] = (page_mask)((1u << valid) - 1u);
                    }
                    const int64_t v = g * QB + i;
                    page4(qs + v * D, dp ? qp + v * 32 : NULL, scale, kt, vrows, vs, mask, mx + v, totv + v * 16, acc + v * D, c);
                }
        }
        for (int64_t v = 0; v < NV; v++) tot[v] = sum16(totv + v * 16);
    } else
#endif
    for (int64_t p = 0; p < num_pages; p++) {
        const int64_t t0 = p * PS, rows = ctx - t0 < PS ? ctx - t0 : PS;
        const int64_t off = (int64_t)pages[p] * page_stride;
        /* K rows of head h, transposed: kt[d][r]; only this head's D values of each row,
         * converted (bfloat16) or read in place */
        const float *src = (const float *)k_cache + off + h * D;
        if (bf16) {
            for (int64_t r = 0; r < rows; r++) load_bf16(row + r * D, (const uint16_t *)k_cache + off + r * W + h * D, D);
            src = row;
        }
        const int64_t sw = bf16 ? D : W;
        for (int64_t r = 0; r < PS; r++)
            for (int64_t d = 0; d < D; d++) kt[d * PS + r] = r < rows ? src[r * sw + d] : 0.0f;
        for (int64_t r = 0; r < rows; r++) {
            if (bf16) load_bf16(vb + r * D, (const uint16_t *)v_cache + off + r * W + h * D, D);
            else memcpy(vb + r * D, (const float *)v_cache + off + r * W + h * D, sizeof(float) * D);
        }
        const int full = t0 + PS - 1 <= first; /* no query row is masked in this page */
        for (int64_t g = 0; g < G; g++)
            for (int64_t i = 0; i < nq; i++) {
                const int64_t v = g * QB + i, a = first + i;
                if (t0 > a) continue; /* whole page in this row's future */
                float *restrict sv = s + v * PS;
                const float *restrict qv = qs + v * D;
                float sc[PS];
#pragma omp simd
                for (int64_t r = 0; r < PS; r++) sc[r] = 0.0f;
                for (int64_t d = 0; d < D; d++) {
                    const float x = qv[d];
#pragma omp simd
                    for (int64_t r = 0; r < PS; r++) sc[r] += x * kt[d * PS + r];
                }
                const int64_t valid = full ? rows : (a - t0 + 1 < rows ? a - t0 + 1 : rows);
                float m = mx[v];
                for (int64_t r = 0; r < valid; r++) m = sc[r] > m ? sc[r] : m;
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t r = 0; r < PS; r++) {
                    const float e = r < valid ? fast_exp(sc[r] - m) : 0.0f;
                    sv[r] = e;
                    sum += e;
                }
                float *restrict o = acc + v * D;
                if (m > mx[v]) {
                    const float alpha = fast_exp(mx[v] - m);
                    tot[v] *= alpha;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) o[d] *= alpha;
                    mx[v] = m;
                }
                tot[v] += sum;
                for (int64_t r = 0; r < valid; r++) {
                    const float w = sv[r];
                    const float *restrict vr = vb + r * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) o[d] += w * vr[d];
                }
            }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < nq; i++) {
            const int64_t v = g * QB + i;
            const float inv = 1.0f / tot[v];
            float *dst = out + (i0 + i) * H * D + (h * G + g) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = acc[v * D + d] * inv;
        }
}

static int run(const float *q, const void *k_cache, const void *v_cache, int bf16, const int32_t *pages, int64_t n,
               int64_t ctx, int64_t H, int64_t Hkv, int64_t D, int64_t PS, int64_t page_stride, float scale,
               float *out, int num_threads) {
    const int64_t G = H / Hkv, NV = G * QB, blocks = (n + QB - 1) / QB, tasks = Hkv * blocks;
    const int64_t words = D * PS + PS * D + NV * PS + NV * D + 2 * NV + NV * D + PS * D + NV * 16 + NV * 32;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *work = aligned_alloc(64, sizeof(float) * ((words + 15) / 16 * 16));
        if (!work) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = tasks - 1; t >= 0; t--) { /* longest (last) blocks first */
            if (!work) continue;
            const int64_t h = t % Hkv, b = t / Hkv, i0 = b * QB, nq = n - i0 < QB ? n - i0 : QB;
            if (D == 64 && PS == 16)
                block(q, k_cache, v_cache, bf16, pages, n, ctx, H, Hkv, 64, 16, page_stride, scale, out, h, i0, nq, work);
            else
                block(q, k_cache, v_cache, bf16, pages, n, ctx, H, Hkv, D, PS, page_stride, scale, out, h, i0, nq, work);
        }
        free(work);
    }
    return failed;
}

int prefill_attention_f32(const float *q, const float *k, const float *v, const int32_t *pages, int64_t n, int64_t ctx,
                          int64_t H, int64_t Hkv, int64_t D, int64_t PS, int64_t page_stride, float scale, float *out,
                          int num_threads) {
    return run(q, k, v, 0, pages, n, ctx, H, Hkv, D, PS, page_stride, scale, out, num_threads);
}
int prefill_attention_bf16(const float *q, const uint16_t *k, const uint16_t *v, const int32_t *pages, int64_t n,
                           int64_t ctx, int64_t H, int64_t Hkv, int64_t D, int64_t PS, int64_t page_stride, float scale,
                           float *out, int num_threads) {
    return run(q, k, v, 1, pages, n, ctx, H, Hkv, D, PS, page_stride, scale, out, num_threads);
}
