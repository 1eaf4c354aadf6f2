/* Matmul for the CPU: out [M, N] = x [M, K] @ W[N, K]^T (+ bias), float32 or bfloat16
 * (float32 sums), for every step's linear layers, decode-sized or prefill-sized. Built and
 * loaded by gemm.py; docs/kernels.md has what it measured against oneDNN.
 *
 * Layout. The weight is packed once, at load time, into panels of NR = 48 output columns:
 * - float32: panel p holds W[p*48 + j][k] at [k][j], so one k step of the panel is three
 *   64-byte rows;
 * - bfloat16: K is taken in pairs, and panel p holds (W[n][2i], W[n][2i+1]) for
 *   n = p*48 + j at [i][j], one 32-bit word, which is what vdpbf16ps multiplies a pair of
 *   x's values with.
 * Columns past N are zeros (their sums are never stored).
 *
 * Loop. Threads split the panels; a thread runs each of its panels against blocks of up
 * to MR = 8 rows of x, holding the block's 8 x 48 sums in 24 registers over all of K. The
 * panel comes from memory once, for the first block, and from L2 for the others (a panel
 * of K = 1536 float32 columns is 288 KiB). Meanwhile each block prefetches its share of
 * the next panel into L2: the hardware prefetcher alone left the step's large matrices
 * (gate|up, the LM head) slower than oneDNN inside the engine, where attention and the
 * other layers stream through the caches between them.
 *
 * Without AVX-512, an AVX2 kernel on the same panels (float32 and bfloat16; see its section).
 *
 * Numerics: float32 fused multiply-adds in k order for each output (oneDNN and MKL block
 * K differently, so results differ from theirs in the last bits); bfloat16 sums pairs by
 * vdpbf16ps in float32, adds the bias in float32 and rounds once to nearest even, as
 * oneDNN does.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NR 48
#define MR 8

/* Bit 1: the float32 kernel runs here; bit 2: the bfloat16 one (the library is built with
 * -march=native, so this is what the CPU has). Not bfloat16 where the CPU has AMX: oneDNN
 * multiplies bfloat16 with its tiles there, which vdpbf16ps cannot approach. */
int gemm_supported(void) {
    int bits = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    bits |= 1;
#endif
#if defined(__AVX512F__)
#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
    bits |= 2;
#endif
#elif defined(__AVX2__) && defined(__FMA__)
    bits |= 2; /* without AVX-512, oneDNN has no bfloat16 linear to fall back on */
#endif
    return bits;
}

static int64_t panels_of(int64_t n) { return (n + NR - 1) / NR; }

/* Both packs read W in its own order, row by row: a checkpoint's weights may still be on
 * disk behind a memory map, and a column-order read of one faulted its pages in at random
 * (a cold start took 16 s, not 5). */
int pack_f32(const float *w, int64_t n, int64_t k, float *out) {
    memset(out, 0, (size_t)(panels_of(n) * NR * k) * sizeof(float));
    for (int64_t col = 0; col < n; col++) {
        float *dst = out + (col / NR) * k * NR + col % NR;
        for (int64_t kk = 0; kk < k; kk++)
            dst[kk * NR] = w[col * k + kk];
    }
    return 0;
}

/* k even. */
int pack_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *out) {
    if (k % 2)
        return 1;
    memset(out, 0, (size_t)(panels_of(n) * NR * k) * sizeof(uint16_t));
    for (int64_t col = 0; col < n; col++) {
        uint16_t *dst = out + (col / NR) * k * NR + (col % NR) * 2;
        for (int64_t i = 0; i < k / 2; i++) {
            dst[i * NR * 2] = w[col * k + 2 * i];
            dst[i * NR * 2 + 1] = w[col * k + 2 * i + 1];
        }
    }
    return 0;
}

/* Where a block of rows prefetches the next panel from: each block of a panel takes an
 * equal share of the next panel's bytes, `lines` 64-byte lines a step of K, so the next
 * panel arrives while this one computes from L2. */
typedef struct {
    const char *next;
    int64_t bytes;
    int64_t lines;
} Prefetch;

/* The whole multiply, ROW_CHUNK rows at a time: threads split the panels, each panel meets
 * every block of rows of the chunk, so the chunk's rows are read again for every panel.
 * AVX-512 (Zen 4): 4096 rows in one pass measured 6% slower than oneDNN, 2048 0.5-5% faster.
 * AVX2 (Zen 3, an L3 shared with other tenants): in chunks of 192 rows (at K = 576 a
 * chunk's x, 442 KiB, about fills L2, and the panels stream past it), the engine prefilled
 * the uniform workload's prompts in 17.6-18.9 s against 18.6-22.6 in chunks of 2048, the
 * two alternating (the linears alone ran level in chunks of 48, 96 or 256 KiB of x). */
#if defined(__AVX512F__)
#define ROW_CHUNK 2048
#else
#define ROW_CHUNK 192
#endif
#define GEMM(NAME, T)                                                                               \
    int NAME(const T *x, int64_t rows, int64_t k, const T *packed, int64_t n, const T *bias,       \
             T *out, int threads) {                                                               \
        for (int64_t first = 0; first < rows; first += ROW_CHUNK) {                               \
            const int64_t chunk = rows - first < ROW_CHUNK ? rows - first : ROW_CHUNK;            \
            if (NAME##_rows(x + first * k, chunk, k, packed, n, bias, out + first * n, threads))  \
                return 1;                                                                         \
        }                                                                                         \
        return 0;                                                                                 \
    }

#if defined(__AVX512F__)
#include <immintrin.h>

/* Columns of a panel that exist (the last panel may be partial), as three 16-lane masks. */
static inline void column_masks(int64_t cols, __mmask16 m[3]) {
    for (int j = 0; j < 3; j++) {
        const int64_t c = cols - 16 * j;
        m[j] = c >= 16 ? (__mmask16)0xffff : c <= 0 ? (__mmask16)0 : (__mmask16)((1u << c) - 1);
    }
}

/* A block of `mr` rows (a compile-time constant after inlining, so the sums stay in
 * registers) against one panel; a, c: the block's first row. */
#define BLOCK(NAME, T, LOAD_B, STEPS, MADD, STORE_ROW)                                              \
    static inline __attribute__((always_inline)) void NAME(const int mr, const T *a, int64_t k,     \
                                                          const T *b, const __m512 bias[3],       \
                                                          const __mmask16 m[3], T *c, int64_t ldc, \
                                                          Prefetch pf) {                          \
        __m512 acc[MR][3];                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; r++) for (int j = 0; j < 3; j++)         \
            acc[r][j] = bias[j];                                                                  \
        const int64_t steps = (STEPS), fetching = (pf.bytes + 64 * pf.lines - 1) / (64 * pf.lines); \
        for (int64_t s = 0; s < steps; s++) {                                                     \
            const __m512 b0 = LOAD_B(0), b1 = LOAD_B(1), b2 = LOAD_B(2);                          \
            if (s < fetching)                                                                     \
                for (int64_t l = 0; l < pf.lines; l++)                                            \
                    _mm_prefetch(pf.next + (s * pf.lines + l) * 64, _MM_HINT_T1);                 \
            _Pragma("GCC unroll 8") for (int r = 0; r < mr; r++) {                                \
                MADD(r);                                                                          \
            }                                                                                     \
        }                                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; r++) for (int j = 0; j < 3; j++)         \
            STORE_ROW(c + r * ldc + 16 * j, m[j], acc[r][j]);                                     \
    }

#define F32_LOAD_B(j) _mm512_load_ps(b + s * NR + 16 * (j))
#define F32_MADD(r)                                                                  \
    const __m512 av = _mm512_set1_ps(a[(r) * k + s]);                                \
    acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);                                 \
    acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);                                 \
    acc[r][2] = _mm512_fmadd_ps(av, b2, acc[r][2])
#define F32_STORE(dst, mask, v) _mm512_mask_storeu_ps(dst, mask, v)
BLOCK(block_f32, float, F32_LOAD_B, k, F32_MADD, F32_STORE)

#define GEMM_ROWS(NAME, T, BLOCK_FN, STEPS)                                                        \
    static int NAME##_rows(const T *x, int64_t rows, int64_t k, const T *packed, int64_t n,        \
                            const T *bias, T *out, int threads) {                                 \
        const int64_t panels = panels_of(n), panel = k * NR, blocks = (rows + MR - 1) / MR;       \
        const int64_t share = (panel * (int64_t)sizeof(T) + blocks - 1) / blocks;                 \
        const int64_t lines = (share + 64 * (STEPS) - 1) / (64 * (STEPS));                        \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                        \
        for (int64_t p = 0; p < panels; p++) {                                                    \
            const T *b = packed + p * panel;                                                      \
            __mmask16 m[3];                                                                       \
            column_masks(n - p * NR, m);                                                          \
            __m512 bv[3];                                                                         \
            for (int j = 0; j < 3; j++)                                                           \
                bv[j] = bias ? BIAS_##T(bias + p * NR + 16 * j, m[j]) : _mm512_setzero_ps();      \
            for (int64_t blk = 0; blk < blocks; blk++) {                                          \
                const int64_t r0 = blk * MR, off = blk * share, left = panel * (int64_t)sizeof(T) - off; \
                const Prefetch pf = {(const char *)(b + panel) + off,                             \
                                     p + 1 < panels ? (share < left ? share : left) : 0, lines};  \
                const T *a = x + r0 * k;                                                          \
                T *c = out + r0 * n + p * NR;                                                     \
                switch (rows - r0 < MR ? rows - r0 : MR) {                                        \
                case 8: BLOCK_FN(8, a, k, b, bv, m, c, n, pf); break;                             \
                case 7: BLOCK_FN(7, a, k, b, bv, m, c, n, pf); break;                             \
                case 6: BLOCK_FN(6, a, k, b, bv, m, c, n, pf); break;                             \
                case 5: BLOCK_FN(5, a, k, b, bv, m, c, n, pf); break;                             \
                case 4: BLOCK_FN(4, a, k, b, bv, m, c, n, pf); break;                             \
                case 3: BLOCK_FN(3, a, k, b, bv, m, c, n, pf); break;                             \
                case 2: BLOCK_FN(2, a, k, b, bv, m, c, n, pf); break;                             \
                default: BLOCK_FN(1, a, k, b, bv, m, c, n, pf); break;                            \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        return 0;                                                                                 \
    }

#define BIAS_float(src, mask) _mm512_maskz_loadu_ps(mask, src)
GEMM_ROWS(gemm_f32, float, block_f32, k)
GEMM(gemm_f32, float)

#if defined(__AVX512BF16__)
static inline __m512bh pair_of(const uint16_t *src) {
    int32_t v;
    memcpy(&v, src, sizeof v);
    return (__m512bh)_mm512_set1_epi32(v);
}

#define BF16_LOAD_B(j) ((__m512)_mm512_load_si512(b + (s * NR + 16 * (j)) * 2))
#define BF16_MADD(r)                                                                           \
    const __m512bh av = pair_of(a + (r) * k + 2 * s);                                          \
    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, (__m512bh)b0);                                \
    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, (__m512bh)b1);                                \
    acc[r][2] = _mm512_dpbf16_ps(acc[r][2], av, (__m512bh)b2)
#define BF16_STORE(dst, mask, v) \
    _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(v))
BLOCK(block_bf16, uint16_t, BF16_LOAD_B, k / 2, BF16_MADD, BF16_STORE)

/* bfloat16 to float32 is a 16-bit shift. */
#define BIAS_uint16_t(src, mask) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, src)), 16))
GEMM_ROWS(gemm_bf16, uint16_t, block_bf16, k / 2)
GEMM(gemm_bf16, uint16_t)
#endif

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* AVX2 (16 registers of 8 floats). Tiles of the same panels: `mr` rows by `cv` vectors of 8
 * columns from column `col` of the panel, mr * cv <= 12 sums in registers. Blocks of up to 6
 * rows take the panel in thirds (16 columns: one 64-byte line of each float32 step of K);
 * one or two rows (decode at batch 1-2) take it whole. `a`: the block's rows, float32,
 * interleaved ([k][6]). bfloat16: each pair of the panel is split into its even and odd k
 * (shifts) on every step, or the panel comes converted (see unpair), and the float32 sums
 * are rounded once to nearest even. */
#define B_F32(j) _mm256_load_ps((const float *)b + s * NR + col + 8 * (j))
#define B_EVEN(j) _mm256_castsi256_ps(_mm256_slli_epi32( \
    _mm256_loadu_si256((const __m256i *)((const uint16_t *)b + 2 * (s * NR + col + 8 * (j)))), 16))
#define B_ODD(j) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32( /* two shifts: no mask register */ \
    _mm256_loadu_si256((const __m256i *)((const uint16_t *)b + 2 * (s * NR + col + 8 * (j)))), 16), 16))
/* One step of K into the sums. 15 registers live at most: the sums, then the broadcasts of
 * x (two rows) or the two vectors of the panel (3-6 rows) and one of the other. */
#define K_STEP(LOAD_B, ka)                                                                           \
    if (mr <= 2) {                                                                                   \
        __m256 av[2];                                                                                \
        _Pragma("GCC unroll 2") for (int r = 0; r < mr; r++) av[r] = _mm256_broadcast_ss(a + (ka) * 6 + r); \
        _Pragma("GCC unroll 6") for (int j = 0; j < cv; j++) {                                       \
            const __m256 bj = LOAD_B(j);                                                             \
            _Pragma("GCC unroll 2") for (int r = 0; r < mr; r++) acc[r][j] = _mm256_fmadd_ps(av[r], bj, acc[r][j]); \
        }                                                                                            \
    } else {                                                                                         \
        __m256 b0 = LOAD_B(0), b1 = LOAD_B(1);                                                       \
        __asm__("" : "+x"(b0), "+x"(b1)); /* in registers: gcc would load them again for each row */ \
        _Pragma("GCC unroll 6") for (int r = 0; r < mr; r++) {                                       \
            const __m256 x = _mm256_broadcast_ss(a + (ka) * 6 + r);                                  \
            acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);                                           \
            acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);                                           \
        }                                                                                            \
    }

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* x's element i as float32 (bf16: x holds bfloat16). */
static inline float x_at(const void *x, const int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* The rows in (rows + 5) / 6 blocks of at most 6, as even as they go: block `blk` holds
 * `mr` rows from row `r0`. 32 rows (a decode step's batch) make 6, 6, 5, 5, 5, 5, not five
 * blocks of 6 and one of 2, whose tiles' 4 sums a step left the FMA units half idle. */
static inline void block_rows(int64_t rows, int64_t blk, int64_t *r0, int *mr) {
    const int64_t blocks = (rows + 5) / 6, base = rows / blocks, extra = rows % blocks;
    *r0 = blk * base + (blk < extra ? blk : extra);
    *mr = (int)(base + (blk < extra));
}

/* x copied (bfloat16: converted) into its blocks of rows interleaved, [k][6] each (a block
 * under 6 rows padded with zeros), by the threads of the enclosing parallel region, each
 * writing whole blocks in order. */
static void interleave(const void *x, const int bf16, int64_t rows, int64_t k, float *conv) {
    const int64_t blocks = (rows + 5) / 6, size = bf16 ? 2 : 4;
    _Pragma("omp for schedule(static)") for (int64_t blk = 0; blk < blocks; blk++) {
        int64_t r0;
        int mr;
        block_rows(rows, blk, &r0, &mr);
        float *dst = conv + blk * 6 * k;
        const void *src = (const char *)x + r0 * k * size;
        if (mr == 6)
            for (int64_t s = 0; s < k; s++)
                _Pragma("GCC unroll 6") for (int r = 0; r < 6; r++) dst[6 * s + r] = x_at(src, bf16, r * k + s);
        else
            for (int64_t s = 0; s < k; s++)
                for (int r = 0; r < 6; r++) dst[6 * s + r] = r < mr ? x_at(src, bf16, r * k + s) : 0.0f;
    }
}

/* The tile; b: the panel (float32, or bfloat16 pairs when `pairs`); bias: the panel's, or
 * NULL, and c: the tile's first row at the panel's first column, both bfloat16 when `bf16`. */
static inline __attribute__((always_inline)) void tile(const int pairs, const int bf16, const int mr, const int cv,
                                                       const float *a, int64_t k, const void *b, int col, int cols,
                                                       const void *bias, void *c, int64_t ldc, Prefetch pf,
                                                       const int resume) {
    __m256 acc[6][6];
    __m256i mask[6];
    for (int j = 0; j < cv; j++) {
        mask[j] = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - col - 8 * j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        if (resume) { /* float32: the sums of the steps of K before these, from c */
            for (int r = 0; r < mr; r++) {
                const float *src = (const float *)c + r * ldc + col + 8 * j;
                acc[r][j] = cols - col >= 8 * (j + 1) ? _mm256_loadu_ps(src) : _mm256_maskload_ps(src, mask[j]);
            }
            continue;
        }
        __m256 bv = _mm256_setzero_ps();
        if (bias && bf16) {
            float f[8] = {0};
            for (int l = 0; l < 8 && col + 8 * j + l < cols; l++) f[l] = bf16_to_f32(((const uint16_t *)bias)[col + 8 * j + l]);
            bv = _mm256_loadu_ps(f);
        } else if (bias)
            bv = _mm256_maskload_ps((const float *)bias + col + 8 * j, mask[j]);
        for (int r = 0; r < mr; r++) acc[r][j] = bv;
    }
    const int64_t steps = pairs ? k / 2 : k, fetching = (pf.bytes + 64 * pf.lines - 1) / (64 * pf.lines);
    for (int64_t s = 0; s < steps; s++) {
        if (s < fetching)
            for (int64_t l = 0; l < pf.lines; l++) _mm_prefetch(pf.next + (s * pf.lines + l) * 64, _MM_HINT_T1);
        if (pairs) {
            K_STEP(B_EVEN, 2 * s)
            K_STEP(B_ODD, 2 * s + 1)
        } else {
            K_STEP(B_F32, s)
        }
    }
    if (!bf16) {
        /* Masked stores only where the panel ends inside the tile: vmaskmovps is microcoded on
         * Zen 3. With masked stores everywhere (and x copied row by row) the 30 layers'
         * linears at 2048 rows ran at 74-96 GFLOP/s, against 112-122 (docs/kernels.md). */
        const int whole = cols - col >= 8 * cv;
        _Pragma("GCC unroll 6") for (int r = 0; r < mr; r++) _Pragma("GCC unroll 6") for (int j = 0; j < cv; j++) {
            float *dst = (float *)c + r * ldc + col + 8 * j;
            if (whole)
                _mm256_storeu_ps(dst, acc[r][j]);
            else
                _mm256_maskstore_ps(dst, mask[j], acc[r][j]);
        }
        return;
    }
    /* Through memory, with every index a constant: a loop indexing acc at run time would keep
     * all of it on the stack, stored on every step of K. */
    uint32_t v[6][48];
    _Pragma("GCC unroll 6") for (int r = 0; r < mr; r++) _Pragma("GCC unroll 6") for (int j = 0; j < cv; j++)
        _mm256_storeu_ps((float *)v[r] + 8 * j, acc[r][j]);
    const int width = cols - col < 8 * cv ? cols - col : 8 * cv;
    for (int r = 0; r < mr; r++)
        for (int l = 0; l < width; l++)
            ((uint16_t *)c)[r * ldc + col + l] = (uint16_t)((v[r][l] + 0x7fffu + ((v[r][l] >> 16) & 1u)) >> 16);
}

/* A bfloat16 pair panel as a float32 one ([k][48]): past UNPAIR_ROWS rows the panel is
 * converted once and the float32 tiles run on it (the even/odd split on every step cost them
 * a third of their rate); up to there, reading half the bytes matters more. */
#define UNPAIR_ROWS 8
static void unpair(const uint16_t *b, int64_t k, float *restrict f) {
    for (int64_t i = 0; i < k / 2; i++)
        for (int j = 0; j < NR; j += 8) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(b + 2 * (i * NR + j)));
            _mm256_store_ps(f + 2 * i * NR + j, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
            _mm256_store_ps(f + (2 * i + 1) * NR + j,
                            _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u))));
        }
}

/* One block of `mr` rows against a panel (`pairs`: still bfloat16 pairs). */
#define BLOCK_AVX2(PAIRS, BF16, b)                                                                    \
    if (mr == 2) tile(PAIRS, BF16, 2, 6, a, k, b, 0, cols, pb, c, n, pf, 0);                          \
    else if (mr == 1) tile(PAIRS, BF16, 1, 6, a, k, b, 0, cols, pb, c, n, pf, 0);                     \
    else                                                                                              \
        for (int col = 0; col < cols; col += 16) {                                                    \
            const Prefetch q = col ? none : pf;                                                       \
            switch (mr) {                                                                             \
            case 6: tile(PAIRS, BF16, 6, 2, a, k, b, col, cols, pb, c, n, q, 0); break;               \
            case 5: tile(PAIRS, BF16, 5, 2, a, k, b, col, cols, pb, c, n, q, 0); break;               \
            case 4: tile(PAIRS, BF16, 4, 2, a, k, b, col, cols, pb, c, n, q, 0); break;               \
            default: tile(PAIRS, BF16, 3, 2, a, k, b, col, cols, pb, c, n, q, 0); break;              \
            }                                                                                         \
        }

/* Threads split the panels; each panel meets every block of 6 rows, and each block prefetches
 * its share of the next panel. x is first copied (bfloat16: converted) into blocks of 6 rows
 * interleaved, [k][6], so a step's broadcasts read one line, not six rows k apart (3-7%
 * faster at 256-2048 rows); a thread copies whole blocks, writing each in order (copying
 * row by row, k apart, took 1.4 ms of a [2048, 1536] input against 0.8); bfloat16 past
 * UNPAIR_ROWS rows converts each panel too, into the thread's buffer. 1: no memory for
 * those. */
#define GEMM_ROWS_AVX2(NAME, T, BF16)                                                                  \
    static int NAME##_rows(const T *x, int64_t rows, int64_t k, const T *packed, int64_t n, const T *bias, \
                           T *out, int threads) {                                                      \
        const int64_t panels = panels_of(n), panel = k * NR, blocks = (rows + 5) / 6;                  \
        const int64_t share = (panel * (int64_t)sizeof(T) + blocks - 1) / blocks;                     \
        const int64_t lines = (share + 64 * k - 1) / (64 * k);                                         \
        float *conv = malloc(sizeof(float) * blocks * 6 * k);                                          \
        if (!conv)                                                                                     \
            return 1;                                                                                  \
        int failed = 0;                                                                                \
        _Pragma("omp parallel num_threads(threads)") {                                                 \
            float *fp = BF16 && rows > UNPAIR_ROWS ? aligned_alloc(64, sizeof(float) * panel) : NULL; \
            if (BF16 && rows > UNPAIR_ROWS && !fp) {                                                \
                _Pragma("omp atomic write") failed = 1;                                                \
            }                                                                                          \
            interleave(x, BF16, rows, k, conv);                                                        \
            _Pragma("omp for schedule(static)") for (int64_t p = 0; p < panels; p++) {                 \
                if (BF16 && rows > UNPAIR_ROWS && !fp) continue;                                    \
                const T *b = packed + p * panel, *pb = bias ? bias + p * NR : NULL;                    \
                const int cols = n - p * NR < NR ? (int)(n - p * NR) : NR;                             \
                if (fp) unpair((const uint16_t *)b, k, fp);                                            \
                for (int64_t blk = 0; blk < blocks; blk++) {                                           \
                    const int64_t off = blk * share, left = panel * (int64_t)sizeof(T) - off;          \
                    const Prefetch pf = {(const char *)(b + panel) + off,                              \
                                         p + 1 < panels ? (share < left ? share : left) : 0, lines},   \
                                   none = {NULL, 0, 1};                                                \
                    int64_t r0;                                                                        \
                    int mr;                                                                            \
                    block_rows(rows, blk, &r0, &mr);                                                   \
                    const float *a = conv + blk * 6 * k;                                               \
                    T *c = out + r0 * n + p * NR;                                                      \
                    if (fp) {                                                                          \
                        BLOCK_AVX2(0, BF16, fp)                                                        \
                    } else {                                                                           \
                        BLOCK_AVX2(BF16, BF16, b)                                                      \
                    }                                                                                  \
                }                                                                                      \
            }                                                                                          \
            free(fp);                                                                                  \
        }                                                                                              \
        free(conv);                                                                                    \
        return failed;                                                                                 \
    }
GEMM_ROWS_AVX2(gemm_f32_whole_k, float, 0)

/* float32 from BLOCKED_ROWS rows: K in chunks of up to KC steps, as BLIS does. For each chunk
 * of a panel, a third of the panel's columns (KC x 16, 16 KiB) stays in L1 while every block
 * of rows runs past it, its x (6 x KC, 6 KiB) from L2; the tiles of later chunks resume from
 * the sums in `out`. Over all of K at once, every tile read its third of the panel (36-96
 * KiB) and its x block again from L2. The same fused multiply-adds in the same k order: the
 * results are bit for bit those of the whole-K loop. */
#define KC 256
#define BLOCKED_ROWS 3
static int gemm_f32_blocked_rows(const float *x, int64_t rows, int64_t k, const float *packed, int64_t n,
                                 const float *bias, float *out, int threads) {
    const int64_t panels = panels_of(n), panel = k * NR, blocks = (rows + 5) / 6;
    const int64_t chunks = (k + KC - 1) / KC, kc_max = (k + chunks - 1) / chunks;
    const float *end = packed + panels * panel;
    float *conv = malloc(sizeof(float) * blocks * 6 * k);
    if (!conv)
        return 1;
    _Pragma("omp parallel num_threads(threads)") {
        interleave(x, 0, rows, k, conv);
        _Pragma("omp for schedule(static)") for (int64_t p = 0; p < panels; p++) {
            const float *b = packed + p * panel, *pb = bias ? bias + p * NR : NULL;
            const int cols = n - p * NR < NR ? (int)(n - p * NR) : NR;
            for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
                const int64_t kc = k - k0 < kc_max ? k - k0 : kc_max;
                /* Every tile of this chunk prefetches its share of the next chunk (or panel). */
                const float *next = b + (k0 + kc) * NR;
                const int64_t tiles = blocks * ((cols + 15) / 16);
                const int64_t bytes = next < end ? kc_max * NR * (int64_t)sizeof(float) : 0;
                const int64_t share = (bytes + tiles - 1) / tiles, lines = share ? (share + 64 * kc - 1) / (64 * kc) : 1;
                int64_t t = 0;
                for (int col = 0; col < cols; col += 16)
                    for (int64_t blk = 0; blk < blocks; blk++, t++) {
                        const int64_t off = t * share < bytes ? t * share : bytes;
                        const Prefetch pf = {(const char *)next + off, bytes - off < share ? bytes - off : share,
                                             lines};
                        int64_t r0;
                        int mr;
                        block_rows(rows, blk, &r0, &mr);
                        const float *a = conv + blk * 6 * k + k0 * 6, *bk = b + k0 * NR, *bias0 = k0 ? NULL : pb;
                        float *c = out + r0 * n + p * NR;
                        switch (mr) {
                        case 6: tile(0, 0, 6, 2, a, kc, bk, col, cols, bias0, c, n, pf, k0 > 0); break;
                        case 5: tile(0, 0, 5, 2, a, kc, bk, col, cols, bias0, c, n, pf, k0 > 0); break;
                        case 4: tile(0, 0, 4, 2, a, kc, bk, col, cols, bias0, c, n, pf, k0 > 0); break;
                        case 3: tile(0, 0, 3, 2, a, kc, bk, col, cols, bias0, c, n, pf, k0 > 0); break;
                        case 2: tile(0, 0, 2, 2, a, kc, bk, col, cols, bias0, c, n, pf, k0 > 0); break;
                        default: tile(0, 0, 1, 2, a, kc, bk, col, cols, bias0, c, n, pf, k0 > 0); break;
                        }
                    }
            }
        }
    }
    free(conv);
    return 0;
}

static int gemm_f32_rows(const float *x, int64_t rows, int64_t k, const float *packed, int64_t n,
                         const float *bias, float *out, int threads) {
    return (rows >= BLOCKED_ROWS ? gemm_f32_blocked_rows : gemm_f32_whole_k_rows)(x, rows, k, packed, n, bias,
                                                                                out, threads);
}
GEMM(gemm_f32, float)
GEMM_ROWS_AVX2(gemm_bf16, uint16_t, 1)
GEMM(gemm_bf16, uint16_t)
#endif

/* Where a kernel is not built, its symbol still is (gemm_supported says not to call it), so
 * the library loads the same everywhere. */
#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
int gemm_f32(const float *x, int64_t rows, int64_t k, const float *packed, int64_t n, const float *bias,
             float *out, int threads) {
    (void)x, (void)rows, (void)k, (void)packed, (void)n, (void)bias, (void)out, (void)threads;
    return 1;
}
#endif
#if !(defined(__AVX512F__) && defined(__AVX512BF16__)) && !(!defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__))
int gemm_bf16(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *packed, int64_t n, const uint16_t *bias,
              uint16_t *out, int threads) {
    (void)x, (void)rows, (void)k, (void)packed, (void)n, (void)bias, (void)out, (void)threads;
    return 1;
}
#endif
