/* Building blocks shared by the C attention kernels: a float rounded to bfloat16 bits, and
 * with AVX-512 a 16-lane exp, a 16 x 16 transpose of 32-bit words and bfloat16 rows
 * interleaved in pairs for vdpbf16ps (with AVX2 only: an 8-lane exp and the transpose on
 * 8-lane registers), each compiled only where the CPU has the instructions (the kernels are
 * built with -march=native). */
#ifndef PDSERVE_ATTENTION_TILES_H
#define PDSERVE_ATTENTION_TILES_H
#include <stdint.h>

/* x rounded to bfloat16 (nearest even; exact for a query that was bfloat16), as its bits. */
static inline uint16_t bf16_bits(float x) {
    union { float f; uint32_t i; } u = { .f = x };
    return (uint16_t)((u.i + 0x7fffu + ((u.i >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* fast_exp for 16 lanes: the same reduction and polynomial; no clamp, since scalef (p * 2^n)
 * flushes to zero far below and the softmax never passes TAU above. */
static inline __m512 exp16s(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#if defined(__AVX512BF16__)
/* A page's 16 bfloat16 V rows of 64 (`stride` apart; rows past `rows`: zeros) in pairs:
 * dst[i][d] = (v[2i][d], v[2i + 1][d]) as 32-bit words (64-byte aligned), what vdpbf16ps
 * sums two rows a lane from. */
static inline void pair_rows(const uint16_t *src, int64_t stride, int64_t rows, void *dst) {
    static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_loadu_si512(lo_idx), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t i = 0; i < 8; i++) {
        const int64_t r = 2 * i;
        const __m512i z = _mm512_setzero_si512();
        const __m512i a0 = r < rows ? _mm512_loadu_si512(src + r * stride) : z;
        const __m512i a1 = r < rows ? _mm512_loadu_si512(src + r * stride + 32) : z;
        const __m512i b0 = r + 1 < rows ? _mm512_loadu_si512(src + (r + 1) * stride) : z;
        const __m512i b1 = r + 1 < rows ? _mm512_loadu_si512(src + (r + 1) * stride + 32) : z;
        _mm512_store_si512((uint32_t *)dst + i * 64, _mm512_permutex2var_epi16(a0, lo, b0));
        _mm512_store_si512((uint32_t *)dst + i * 64 + 16, _mm512_permutex2var_epi16(a0, hi, b0));
        _mm512_store_si512((uint32_t *)dst + i * 64 + 32, _mm512_permutex2var_epi16(a1, lo, b1));
        _mm512_store_si512((uint32_t *)dst + i * 64 + 48, _mm512_permutex2var_epi16(a1, hi, b1));
    }
}
#endif

/* dst[j][r] = src[r * stride + j] for a 16 x 16 block of 32-bit words (rows past `rows`:
 * zeros), in registers: a page's K transposed, 16 dimensions (float32) or 16 pairs
 * (bfloat16) at a time. */
static inline void transpose16(const float *src, int64_t stride, int64_t rows, float *restrict dst) {
    __m512 t[16], a[16];
    for (int r = 0; r < 16; r++) t[r] = r < rows ? _mm512_loadu_ps(src + r * stride) : _mm512_setzero_ps();
    for (int r = 0; r < 16; r += 2) {
        a[r] = _mm512_unpacklo_ps(t[r], t[r + 1]);
        a[r + 1] = _mm512_unpackhi_ps(t[r], t[r + 1]);
    }
    for (int r = 0; r < 16; r += 4)
        for (int j = 0; j < 2; j++) {
            t[r + j] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[r + j]), _mm512_castps_pd(a[r + 2 + j])));
            t[r + 2 + j] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[r + j]), _mm512_castps_pd(a[r + 2 + j])));
        }
    /* t[4g + (0, 2, 1, 3)[i]] holds, in each 128-bit lane L, rows 4g..4g+3 of word 4L + i */
    for (int i = 0; i < 4; i++) {
        const int j = (int[]){0, 2, 1, 3}[i];
        const __m512 p = _mm512_shuffle_f32x4(t[j], t[4 + j], 0x88), q = _mm512_shuffle_f32x4(t[j], t[4 + j], 0xdd);
        const __m512 r = _mm512_shuffle_f32x4(t[8 + j], t[12 + j], 0x88), s = _mm512_shuffle_f32x4(t[8 + j], t[12 + j], 0xdd);
        _mm512_store_ps(dst + i * 16, _mm512_shuffle_f32x4(p, r, 0x88));
        _mm512_store_ps(dst + (4 + i) * 16, _mm512_shuffle_f32x4(q, s, 0x88));
        _mm512_store_ps(dst + (8 + i) * 16, _mm512_shuffle_f32x4(p, r, 0xdd));
        _mm512_store_ps(dst + (12 + i) * 16, _mm512_shuffle_f32x4(q, s, 0xdd));
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* fast_exp for 8 lanes (AVX2): the same clamp, reduction and polynomial. */
static inline __m256 exp8s(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

/* transpose16's contract on 8-lane registers: four 8 x 8 blocks, each by unpacks,
 * shuffles and lane swaps (a page's K, once per page). */
static inline void transpose16(const float *src, int64_t stride, int64_t rows, float *restrict dst) {
    for (int rb = 0; rb < 16; rb += 8)
        for (int cb = 0; cb < 16; cb += 8) {
            __m256 t[8], u[8];
            for (int r = 0; r < 8; r++)
                t[r] = rb + r < rows ? _mm256_loadu_ps(src + (rb + r) * stride + cb) : _mm256_setzero_ps();
            for (int r = 0; r < 8; r += 2) {
                u[r] = _mm256_unpacklo_ps(t[r], t[r + 1]);
                u[r + 1] = _mm256_unpackhi_ps(t[r], t[r + 1]);
            }
            for (int r = 0; r < 8; r += 4)
                for (int j = 0; j < 2; j++) {
                    t[r + 2 * j] = _mm256_shuffle_ps(u[r + j], u[r + 2 + j], 0x44);
                    t[r + 2 * j + 1] = _mm256_shuffle_ps(u[r + j], u[r + 2 + j], 0xee);
                }
            /* t[4h + i] holds, in each 128-bit lane L, rows 4h..4h+3 of column 4L + i */
            for (int i = 0; i < 4; i++) {
                _mm256_storeu_ps(dst + (cb + i) * 16 + rb, _mm256_permute2f128_ps(t[i], t[4 + i], 0x20));
                _mm256_storeu_ps(dst + (cb + 4 + i) * 16 + rb, _mm256_permute2f128_ps(t[i], t[4 + i], 0x31));
            }
        }
}
#endif /* __AVX512F__, __AVX2__ */
#endif
