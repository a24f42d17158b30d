/* y[m, n] = sum_k x[m, k] * w[n, k]  (+ r[m, n]), the weights stored as 8-bit codes: w[n, k] = d * q[n, k] + o for
 * each output channel's block of BK columns, with its own scale d and offset o (floats). Float32 activations
 * (W8A32), for the CPU's decode steps.
 *
 * Why our own: a decode step multiplies a few rows by every weight of the model once, so it is bound by the
 * bytes of weights it reads. 8-bit weights are a quarter of float32's (plus a scale and an offset per 32), but
 * the library kernels that take them either need VNNI for the activations' int8 side (oneDNN's AVX2 path sums
 * pairs of products in 16 bits and saturates) or are 10-30x slower than float32 (torch's _weight_int8pack_mm).
 * Here no activation is quantized: each weight is widened to float in registers and multiplied into every row.
 *
 * Why blocks of 32 with an offset, not one scale per channel: a GGUF's Q4_1, Q5_1 and Q8_0 blocks are 32 columns
 * with a scale (and, but for Q8_0, a minimum), so the weights of a model converted from one (the embedded model
 * is) take at most 256 evenly spaced values in each block: these codes hold them exactly, up to float rounding.
 * One symmetric scale per channel kept float32's greedy token at 96.9% of the positions of bench/quantization.py's
 * prompts; these, at 100%.
 *
 * Why 4-bit codes too: where every code of a weight is under 16 (a GGUF's Q4_1 and Q4_0 blocks: all of the
 * embedded model's layers), two codes share a byte, and a block is 384 bytes instead of 640. The same codes,
 * scales and offsets in the same order of sums, so the products equal the 8-bit ones bit for bit; a decode step
 * reads 0.75 bytes a weight instead of 1.25. Splitting the halves costs a shift and a mask a column, so at one row
 * on a 2-core AMD EPYC Zen 2 the whole SmolLM2's products from memory went from 6.4 to 5.5 ms (bench/cpu_layout.py,
 * 2026-12-07), not to 60%: widening codes to floats (two conversions a column) is what bounds it there, at about
 * 18G weights a second per core from L1 against 24G for 8-bit codes (a one-off loop of this kernel's inner step).
 *
 * The weights are made into codes (int8_codes, in int8_codes.h) and packed (int8_pack) once, into panels of PANEL
 * output channels, a panel one contiguous run that the kernel streams from memory in order: block after block,
 * each its PANEL scales, PANEL offsets, then BK columns of PANEL codes. Each step of k broadcasts one activation
 * per row and adds it times the PANEL weights (two 8-float vectors) into that row's accumulators, the
 * outer-product form of the BLAS kernels.
 * - M <= MR_REG rows: the codes are widened in registers as the panel streams past, summed per block, and the
 *   block's scale and offset applied to the sums (the offset times the sum of the block's activations).
 * - more rows: the panel is widened to its weights KC columns at a time into a small float buffer that stays in
 *   the L1 cache, and every tile of MR rows runs over it.
 *
 * AVX2 + FMA intrinsics where the compiler targets them (-march=native on an x86 CPU of the last decade); plain
 * C elsewhere, which the compiler vectorizes as it can. Threads: OpenMP, which resolves to torch's own libgomp
 * (same soname) in an engine process, so torch's thread count and spin settings hold here too.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

#define PANEL 16 /* output channels per panel: two AVX2 vectors */
#define BK 32    /* columns per block of codes with one scale and offset (a GGUF block) */
#define SCALES_BYTES (2 * PANEL * (int64_t)sizeof(float)) /* a block's PANEL scales, then PANEL offsets: 128 */
/* Bytes of one column of a panel's codes, and of one block, at `bits` a code: 8, or 4 where every code of the
 * weight is under 16 (a GGUF's Q4_1 and Q4_0 blocks), its two channels j and j + 8 in the low and high halves of
 * byte j of the column. */
#define COLUMN_BYTES(bits) (PANEL * (bits) / 8)
#define BLOCK_BYTES(bits) (SCALES_BYTES + BK * COLUMN_BYTES(bits)) /* 640 at 8 bits, 384 at 4 */
#define MR 6     /* rows per tile over a widened panel: 6 x 2 accumulators + 2 weight vectors + 1 broadcast */
#define MR_REG 3 /* rows widened in registers: 3 x 2 block sums + 3 x 2 totals + 2 weights + 1 broadcast */
#define KC 256   /* columns of a panel widened at a time for more rows: 16 KB of floats, in L1; a multiple of BK */
/* How far ahead (bytes of the panel) the kernels ask for the weights they will read, as data used once
 * (prefetchnta: kept out of the outer caches, which hold the activations and the KV cache). The hardware's own
 * prefetch left a one-row product of the whole model (SmolLM2's weights and head) at 17 GB/s on a 2-core AMD EPYC
 * Zen 2 that sums memory at 35; asked 2 KB ahead, 21 GB/s (0.5 to 4 KB ahead were within 5% of each other), and
 * asked as data used once, 26 GB/s (at the block format's 168 MB: 8.5-9.0 -> 6.4 ms; 8 rows 24.9 -> 23.4 ms; each
 * a one-off comparison in a loop over the engine's packed weights; bench/cpu_layout.py's "products from memory"
 * times the same at 1 / 8 / 32 rows). The panels follow one another in memory, so this runs on into the next one. */
#define AHEAD 2048
#define PREFETCH(p) __builtin_prefetch((p), 0, 0)
#define LINE_COLUMNS(bits) (64 / COLUMN_BYTES(bits)) /* columns of codes in a cache line: asked for once */

#include "int8_codes.h" /* the codes of a float32 weight (int8_codes), which int8_pack packs */

int int8_panel(void) { return PANEL; }

int int8_block(void) { return BK; }

/* Bytes of the packed weights of N channels of K columns at `bits` (8 or 4) a code. */
int64_t int8_packed_bytes(int64_t N, int64_t K, int bits) {
    return (N + PANEL - 1) / PANEL * ((K + BK - 1) / BK) * BLOCK_BYTES(bits);
}

/* q [N, K] codes, scale and offset [N, ceil(K / BK)] -> packed (int8_packed_bytes) at `bits` (8 or 4) a code;
 * channels past N and columns past K get code, scale and offset 0. Panels split among `threads` threads. Returns
 * 0, or -1 where `bits` is neither or a code does not fit in it (the packed codes are then not the weight's). */
int int8_pack(const uint8_t *q, const float *scale, const float *offset, int64_t N, int64_t K, uint8_t *packed,
              int bits, int threads) {
    int64_t blocks = (K + BK - 1) / BK, panels = (N + PANEL - 1) / PANEL;
    int too_wide = 0;
    if (bits != 8 && bits != 4) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1) reduction(| : too_wide)
    for (int64_t p = 0; p < panels; p++) {
        uint8_t *panel = packed + p * blocks * BLOCK_BYTES(bits);
        memset(panel, 0, (size_t)(blocks * BLOCK_BYTES(bits)));
        for (int64_t n = p * PANEL; n < N && n < (p + 1) * PANEL; n++) {
            int j = (int)(n % PANEL);
            for (int64_t b = 0; b < blocks; b++) {
                uint8_t *block = panel + b * BLOCK_BYTES(bits), *codes = block + SCALES_BYTES;
                float *s = (float *)block;
                s[j] = scale[n * blocks + b];
                s[PANEL + j] = offset[n * blocks + b];
                for (int64_t k = b * BK; k < K && k < (b + 1) * BK; k++) {
                    uint8_t c = q[n * K + k];
                    if (bits == 8) {
                        codes[(k - b * BK) * PANEL + j] = c;
                    } else {
                        too_wide |= c > 15;
                        codes[(k - b * BK) * COLUMN_BYTES(4) + j % 8] |= (uint8_t)((c & 15) << (4 * (j / 8)));
                    }
                }
            }
        }
    }
    return too_wide ? -1 : 0;
}

/* The sum of each row's activations over each block of columns: sums [M][ceil(K / BK)]. */
static void block_sums(const float *x, int64_t M, int64_t K, float *sums) {
    int64_t blocks = (K + BK - 1) / BK;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < blocks; b++) {
            float s = 0.0f;
            for (int64_t k = b * BK; k < K && k < (b + 1) * BK; k++) s += x[m * K + k];
            sums[m * blocks + b] = s;
        }
}

#ifdef HAVE_AVX2
/* A column of a panel's codes, at BITS a code, as the PANEL channels' codes in floats: w[0] channels 0-7, w[1]
 * 8-15. At 4 bits one load and widening serves both halves: the low four bits, then the high. */
static inline __attribute__((always_inline)) void widen(const int BITS, const uint8_t *c, __m256 w[2]) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
    if (BITS == 8) {
        w[0] = _mm256_cvtepi32_ps(v);
        w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8))));
    } else {
        w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
        w[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
    }
}

/* MT rows of x (stride K) times one block's codes, columns [0, kb) of it, summed into a[MT][2]. */
static inline __attribute__((always_inline)) void block_codes(const int MT, const int BITS, const float *x,
                                                              int64_t K, const uint8_t *codes, int64_t kb,
                                                              __m256 a[MR][2]) {
    for (int64_t k = 0; k < kb; k++) {
        if (k % LINE_COLUMNS(BITS) == 0) PREFETCH(codes + k * COLUMN_BYTES(BITS) + AHEAD);
        __m256 w[2];
        widen(BITS, codes + k * COLUMN_BYTES(BITS), w);
        __m256 w0 = w[0], w1 = w[1];
        for (int i = 0; i < MT; i++) {
            __m256 b = _mm256_broadcast_ss(x + i * K + k);
            a[i][0] = _mm256_fmadd_ps(b, w0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(b, w1, a[i][1]);
        }
    }
}

/* One row's block (M = 1): four chains of sums over alternate columns, since one pair alone waits on the FMA's
 * latency at every column. */
static inline __attribute__((always_inline)) void block_codes_row(const int BITS, const float *x,
                                                                  const uint8_t *codes, int64_t kb,
                                                                  __m256 a[MR][2]) {
    __m256 c[4][2];
    for (int u = 0; u < 4; u++) c[u][0] = c[u][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 4 <= kb; k += 4) {
        if (k % LINE_COLUMNS(BITS) == 0) PREFETCH(codes + k * COLUMN_BYTES(BITS) + AHEAD);
        for (int u = 0; u < 4; u++) {
            __m256 b = _mm256_broadcast_ss(x + k + u), w[2];
            widen(BITS, codes + (k + u) * COLUMN_BYTES(BITS), w);
            c[u][0] = _mm256_fmadd_ps(b, w[0], c[u][0]);
            c[u][1] = _mm256_fmadd_ps(b, w[1], c[u][1]);
        }
    }
    for (int h = 0; h < 2; h++) a[0][h] = _mm256_add_ps(_mm256_add_ps(c[0][h], c[1][h]), _mm256_add_ps(c[2][h], c[3][h]));
    block_codes(1, BITS, x + k, 0, codes + k * COLUMN_BYTES(BITS), kb - k, a);
}

/* MT <= MR_REG rows times a whole panel, its codes widened in registers: per block, total += scale * sum(x q) +
 * offset * sum(x). */
static inline __attribute__((always_inline)) void tile_codes(const int MT, const int BITS, const float *x,
                                                             int64_t K, const float *sums, const uint8_t *panel,
                                                             __m256 total[MR][2]) {
    int64_t blocks = (K + BK - 1) / BK;
    __m256 t[MR][2];  /* local copies, so that the compiler keeps them in registers through the loops */
    for (int i = 0; i < MT; i++) t[i][0] = t[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = panel + b * BLOCK_BYTES(BITS);
        const float *scale = (const float *)block, *offset = scale + PANEL;
        int64_t k0 = b * BK, kb = K - k0 < BK ? K - k0 : BK;
        __m256 a[MR][2];
        for (int i = 0; i < MT; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
        if (MT == 1) block_codes_row(BITS, x + k0, block + SCALES_BYTES, kb, a);
        else block_codes(MT, BITS, x + k0, K, block + SCALES_BYTES, kb, a);
        for (int h = 0; h < 2; h++) {
            __m256 s = _mm256_loadu_ps(scale + 8 * h), o = _mm256_loadu_ps(offset + 8 * h);
            for (int i = 0; i < MT; i++)
                t[i][h] = _mm256_fmadd_ps(o, _mm256_broadcast_ss(sums + i * blocks + b),
                                          _mm256_fmadd_ps(s, a[i][h], t[i][h]));
        }
    }
    for (int i = 0; i < MT; i++) total[i][0] = t[i][0], total[i][1] = t[i][1];
}

/* A tile's MT rows, packed ([k][MT]: xt), times widened columns [0, kc) of a panel in `buf` ([kc][PANEL]). */
static inline __attribute__((always_inline)) void tile_float(const int MT, const float *xt, const float *buf,
                                                             int64_t kc, __m256 acc[MR][2]) {
    __m256 a[MR][2];  /* as in tile_codes */
    for (int i = 0; i < MT; i++) a[i][0] = acc[i][0], a[i][1] = acc[i][1];
    for (int64_t k = 0; k < kc; k++) {
        __m256 w0 = _mm256_loadu_ps(buf + k * PANEL), w1 = _mm256_loadu_ps(buf + k * PANEL + 8);
        for (int i = 0; i < MT; i++) {
            __m256 b = _mm256_broadcast_ss(xt + k * MT + i);
            a[i][0] = _mm256_fmadd_ps(b, w0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(b, w1, a[i][1]);
        }
    }
    for (int i = 0; i < MT; i++) acc[i][0] = a[i][0], acc[i][1] = a[i][1];
}

/* Columns [k0, k0 + kc) of a panel as weights (scale * code + offset) into buf [kc][PANEL]. */
static inline __attribute__((always_inline)) void widen_columns(const int BITS, const uint8_t *panel, int64_t k0,
                                                                int64_t kc, float *buf) {
    for (int64_t k = k0; k < k0 + kc;) {
        const uint8_t *block = panel + k / BK * BLOCK_BYTES(BITS);
        const float *scale = (const float *)block, *offset = scale + PANEL;
        const uint8_t *codes = block + SCALES_BYTES;
        __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
        __m256 o0 = _mm256_loadu_ps(offset), o1 = _mm256_loadu_ps(offset + 8);
        int64_t end = (k / BK + 1) * BK < k0 + kc ? (k / BK + 1) * BK : k0 + kc;
        for (; k < end; k++) {
            const uint8_t *c = codes + k % BK * COLUMN_BYTES(BITS);
            __m256 w[2];
            if (k % LINE_COLUMNS(BITS) == 0) PREFETCH(c + AHEAD);
            widen(BITS, c, w);
            _mm256_storeu_ps(buf + (k - k0) * PANEL, _mm256_fmadd_ps(w[0], s0, o0));
            _mm256_storeu_ps(buf + (k - k0) * PANEL + 8, _mm256_fmadd_ps(w[1], s1, o1));
        }
    }
}

static inline void zero(__m256 acc[MR][2]) {
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
}

/* y[i, n0 + j] (j < width) = acc (+ r); `add`: onto what y holds. */
static void store(int MT, __m256 acc[MR][2], const float *r, float *y, int64_t N, int width, int add) {
    float out[PANEL];
    for (int i = 0; i < MT; i++) {
        _mm256_storeu_ps(out, acc[i][0]);
        _mm256_storeu_ps(out + 8, acc[i][1]);
        for (int j = 0; j < width; j++) {
            float v = out[j];
            if (add) v += y[i * N + j];
            else if (r) v += r[i * N + j];
            y[i * N + j] = v;
        }
    }
}

#define SWITCH_MT(MT, CALL) \
    switch (MT) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
                  case 4: CALL(4); break; case 5: CALL(5); break; default: CALL(6); break; }

/* One panel of codes of BITS bits, every row. `sums`: block_sums of x (up to MR_REG rows); `xp`: x packed by
 * pack_rows (more rows); `buf`: KC * PANEL floats of this thread's. */
static inline __attribute__((always_inline)) void panel_rows_of(const int BITS, const float *x, const float *sums,
                                                                const float *xp, int64_t M, int64_t K,
                                                                const uint8_t *panel, int width, const float *r,
                                                                float *y, int64_t N, float *buf) {
    __m256 acc[MR][2];
    if (M <= MR_REG) {
        switch (M) {
            case 1: tile_codes(1, BITS, x, K, sums, panel, acc); break;
            case 2: tile_codes(2, BITS, x, K, sums, panel, acc); break;
            default: tile_codes(3, BITS, x, K, sums, panel, acc); break;
        }
        store((int)M, acc, r, y, N, width, 0);
        return;
    }
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t kc = K - k0 < KC ? K - k0 : KC;
        widen_columns(BITS, panel, k0, kc, buf);  /* once for all rows */
        for (int64_t m = 0; m < M; m += MR) {
            int mt = M - m < MR ? (int)(M - m) : MR;
            zero(acc);
#define TILE(T) tile_float(T, xp + m * K + k0 * mt, buf, kc, acc)
            SWITCH_MT(mt, TILE)
#undef TILE
            store(mt, acc, r ? r + m * N : 0, y + m * N, N, width, k0 > 0);
        }
    }
}

/* panel_rows_of, made for each width of code, so that the inner loops know theirs. */
static void panel_rows(int bits, const float *x, const float *sums, const float *xp, int64_t M, int64_t K,
                       const uint8_t *panel, int width, const float *r, float *y, int64_t N, float *buf) {
    if (bits == 4) panel_rows_of(4, x, sums, xp, M, K, panel, width, r, y, N, buf);
    else panel_rows_of(8, x, sums, xp, M, K, panel, width, r, y, N, buf);
}

/* x [M, K] -> xp: each tile of MR rows (the last: what is left) as [K][rows], so that a step of k broadcasts
 * from one cache line. */
static void pack_rows(const float *x, int64_t M, int64_t K, float *xp) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m += MR) {
        int mt = M - m < MR ? (int)(M - m) : MR;
        for (int64_t k = 0; k < K; k++)
            for (int i = 0; i < mt; i++) xp[m * K + k * mt + i] = x[(m + i) * K + k];
    }
}
#else
/* Channel j's code in column k of a block's codes, at `bits` a code. */
static inline int code_at(int bits, const uint8_t *codes, int64_t k, int j) {
    return bits == 8 ? codes[k * PANEL + j] : codes[k * COLUMN_BYTES(4) + j % 8] >> (4 * (j / 8)) & 15;
}

/* Plain C: one panel, every row, the codes widened as they are read, block by block. */
static void panel_rows(int bits, const float *x, const float *sums, const float *xp, int64_t M, int64_t K,
                       const uint8_t *panel, int width, const float *r, float *y, int64_t N, float *buf) {
    (void)xp, (void)buf;
    int64_t blocks = (K + BK - 1) / BK;
    for (int64_t m = 0; m < M; m++) {
        float total[PANEL] = {0};
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *block = panel + b * BLOCK_BYTES(bits);
            const float *scale = (const float *)block, *offset = scale + PANEL;
            const uint8_t *codes = block + SCALES_BYTES;
            float acc[PANEL] = {0};
            for (int64_t k = b * BK; k < K && k < (b + 1) * BK; k++) {
                float v = x[m * K + k];
                for (int j = 0; j < PANEL; j++) acc[j] += v * (float)code_at(bits, codes, k - b * BK, j);
            }
            for (int j = 0; j < PANEL; j++) total[j] += scale[j] * acc[j] + offset[j] * sums[m * blocks + b];
        }
        for (int j = 0; j < width; j++) y[m * N + j] = total[j] + (r ? r[m * N + j] : 0.0f);
    }
}
#endif

/* x [M, K], packed (int8_pack) weights of `bits` a code, r [M, N] or NULL, y [M, N]; all contiguous. The panels
 * are split among `threads` threads. Returns 0, or -1 where the scratch for the rows could not be had. */
int int8_linear(const float *x, int64_t M, int64_t K, const uint8_t *packed, int64_t N, int bits, const float *r,
                float *y, int threads) {
    int64_t panels = (N + PANEL - 1) / PANEL, blocks = (K + BK - 1) / BK;
    float *sums = 0, *xp = 0;
    if (M <= 0 || N <= 0) return 0;  /* nothing to write (a step whose rows need no logits: no row at all) */
#ifdef HAVE_AVX2
    int widened = M > MR_REG;  /* the rows go over a widened panel (xp), else the codes are widened per row (sums) */
#else
    int widened = 0;
#endif
    if (widened ? !(xp = malloc(sizeof(float) * (size_t)(M * K))) : !(sums = malloc(sizeof(float) * (size_t)(M * blocks))))
        return -1;
    if (sums) block_sums(x, M, K, sums);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float buf[KC * PANEL];
#ifdef HAVE_AVX2
        if (xp) pack_rows(x, M, K, xp);  /* ends in the threads' barrier */
#endif
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            int64_t n = p * PANEL;
            int width = N - n < PANEL ? (int)(N - n) : PANEL;
            panel_rows(bits, x, sums, xp, M, K, packed + p * blocks * BLOCK_BYTES(bits), width, r ? r + n : 0, y + n,
                       N, buf);
        }
    }
    free(sums);
    free(xp);
    return 0;
}
