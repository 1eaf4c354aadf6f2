/* Matmul for the CPU: out [M, N] = x [M, K] @ W[N, K]^T (+ bias), float32 or bfloat16
 * (float32 sums), for every step's linear layers, decode-sized or prefill-sized. Built and
 * loaded by gemm.py; see there for what it measured against oneDNN.
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
 * Numerics: float32 fused multiply-adds in k order for each output (oneDNN and MKL block
 * K differently, so results differ from theirs in the last bits); bfloat16 sums pairs by
 * vdpbf16ps in float32, adds the bias in float32 and rounds once to nearest even, as
 * oneDNN does.
 */
#include <stdint.h>
#include <string.h>

#define NR 48
#define MR 8

/* Bit 1: the float32 kernel runs here; bit 2: the bfloat16 one (the library is built with
 * -march=native, so this is what the CPU has). Not bfloat16 where the CPU has AMX: oneDNN
 * multiplies bfloat16 with its tiles there, which vdpbf16ps cannot approach. */
int gemm_supported(void) {
    int bits = 0;
#if defined(__AVX512F__)
    bits |= 1;
#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
    bits |= 2;
#endif
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

#if defined(__AVX512F__)
#include <immintrin.h>

/* Columns of a panel that exist (the last panel may be partial), as three 16-lane masks. */
static inline void column_masks(int64_t cols, __mmask16 m[3]) {
    for (int j = 0; j < 3; j++) {
        const int64_t c = cols - 16 * j;
        m[j] = c >= 16 ? (__mmask16)0xffff : c <= 0 ? (__mmask16)0 : (__mmask16)((1u << c) - 1);
    }
}

/* Where a block of rows prefetches the next panel from: each block of a panel takes an
 * equal share of the next panel's bytes, `lines` 64-byte lines a step of K, so the next
 * panel arrives while this one computes from L2. */
typedef struct {
    const char *next;
    int64_t bytes;
    int64_t lines;
} Prefetch;

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

/* The whole multiply, ROW_CHUNK rows at a time (past that, x's rows stop fitting in L2 and
 * each panel would read them from further out: 4096 rows in one pass measured 6% slower
 * than oneDNN, 2048 0.5-5% faster): threads split the panels, each panel meets every block
 * of rows of the chunk. */
#define ROW_CHUNK 2048
#define GEMM(NAME, T)                                                                               \
    int NAME(const T *x, int64_t rows, int64_t k, const T *packed, int64_t n, const T *bias,       \
             T *out, int threads) {                                                               \
        for (int64_t first = 0; first < rows; first += ROW_CHUNK) {                               \
            const int64_t chunk = rows - first < ROW_CHUNK ? rows - first : ROW_CHUNK;            \
            NAME##_rows(x + first * k, chunk, k, packed, n, bias, out + first * n, threads);      \
        }                                                                                         \
        return 0;                                                                                 \
    }

#define GEMM_ROWS(NAME, T, BLOCK_FN, STEPS)                                                        \
    static void NAME##_rows(const T *x, int64_t rows, int64_t k, const T *packed, int64_t n,       \
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
#endif

/* Where a kernel is not built, its symbol still is (gemm_supported says not to call it), so
 * the library loads the same everywhere. */
#if !defined(__AVX512F__)
int gemm_f32(const float *x, int64_t rows, int64_t k, const float *packed, int64_t n, const float *bias,
             float *out, int threads) {
    (void)x, (void)rows, (void)k, (void)packed, (void)n, (void)bias, (void)out, (void)threads;
    return 1;
}
#endif
#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
int gemm_bf16(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *packed, int64_t n, const uint16_t *bias,
              uint16_t *out, int threads) {
    (void)x, (void)rows, (void)k, (void)packed, (void)n, (void)bias, (void)out, (void)threads;
    return 1;
}
#endif
