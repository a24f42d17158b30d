/* y[m, n] = s[n] * sum_k x[m, k] * q[n, k]  (+ r[m, n]): float32 activations times int8 weights with one scale
 * per output channel (W8A32), for the CPU's decode steps.
 *
 * Why our own: a decode step multiplies a few rows by every weight of the model once, so it is bound by the
 * bytes of weights it reads. int8 weights are a quarter of float32's, but the library kernels that take them
 * either need VNNI for the activations' int8 side (oneDNN's AVX2 path sums pairs of products in 16 bits and
 * saturates) or are 10-30x slower than float32 (torch's _weight_int8pack_mm). Here no activation is quantized:
 * each weight is widened to float in registers and multiplied into every row of the tile.
 *
 * The weights are packed once (int8_pack) into panels of PANEL output channels: panel p holds, for k = 0..K-1,
 * the PANEL weights of channels p*PANEL.. at column k, so a panel is one contiguous run of K*PANEL bytes that the
 * kernel streams from memory in order. Each step of k broadcasts one activation per row and adds it times the
 * PANEL weights (two 8-float vectors) into that row's accumulators, the outer-product form of the BLAS kernels.
 * - M <= MR rows: one tile of rows; each weight is widened once, in registers, as it streams past.
 * - more rows: the panel is widened (and scaled) KC columns at a time into a small float buffer that stays in
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
#define MR 6     /* rows per tile: 6 x 2 accumulators + 2 weight vectors + 1 broadcast fit 16 registers */
#define KC 256   /* columns of a panel widened at a time for more than MR rows: 16 KB of floats, in L1 */
/* How far ahead (in columns of a panel: 16 bytes each) the kernels ask for the weights they will read. The
 * hardware's own prefetch left a one-row product of the whole model (163 MB of SmolLM2's weights and head) at
 * 17 GB/s on a 2-core AMD EPYC Zen 2 that sums memory at 35; asked 2 KB ahead, 21 GB/s (32 to 256 columns ahead
 * were within 5% of each other), and 8 rows 9% faster. The panels follow one another in memory, so this runs on
 * into the next one. */
#define AHEAD 128

int int8_panel(void) { return PANEL; }

/* q [N, K] row-major -> packed [ceil(N / PANEL), K, PANEL], channels past N zero. */
void int8_pack(const int8_t *q, int64_t N, int64_t K, int8_t *packed) {
    int64_t panels = (N + PANEL - 1) / PANEL;
    memset(packed, 0, (size_t)(panels * K * PANEL));
    for (int64_t n = 0; n < N; n++) {
        int8_t *dst = packed + (n / PANEL) * K * PANEL + n % PANEL;
        for (int64_t k = 0; k < K; k++) dst[k * PANEL] = q[n * K + k];
    }
}

#ifdef HAVE_AVX2
static inline __m256 widen(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Rows [MT] of x (stride K) times one panel's columns [k0, k1) widened in registers; acc [MT][2]. */
static inline __attribute__((always_inline)) void tile_int8(const int MT, const float *x, int64_t K,
                                                            const int8_t *panel, int64_t k0, int64_t k1,
                                                            __m256 acc[MR][2]) {
    __m256 a[MR][2];  /* a local copy, so that the compiler keeps it in registers through the loop */
    for (int i = 0; i < MT; i++) a[i][0] = acc[i][0], a[i][1] = acc[i][1];
    for (int64_t k = k0; k < k1; k++) {
        if (k % 4 == 0) __builtin_prefetch(panel + (k + AHEAD) * PANEL);
        __m256 w0 = widen(panel + k * PANEL), w1 = widen(panel + k * PANEL + 8);
        for (int i = 0; i < MT; i++) {
            __m256 b = _mm256_broadcast_ss(x + i * K + k);
            a[i][0] = _mm256_fmadd_ps(b, w0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(b, w1, a[i][1]);
        }
    }
    for (int i = 0; i < MT; i++) acc[i][0] = a[i][0], acc[i][1] = a[i][1];
}

/* One row (M = 1): four chains of accumulators over alternate columns, since one pair alone waits on the
 * FMA's latency at every column. */
static void row_int8(const float *x, int64_t K, const int8_t *panel, __m256 acc[MR][2]) {
    __m256 a[4][2];
    for (int u = 0; u < 4; u++) a[u][0] = a[u][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
        __builtin_prefetch(panel + (k + AHEAD) * PANEL);  /* one cache line: four columns */
        for (int u = 0; u < 4; u++) {
            __m256 b = _mm256_broadcast_ss(x + k + u);
            a[u][0] = _mm256_fmadd_ps(b, widen(panel + (k + u) * PANEL), a[u][0]);
            a[u][1] = _mm256_fmadd_ps(b, widen(panel + (k + u) * PANEL + 8), a[u][1]);
        }
    }
    for (int h = 0; h < 2; h++) acc[0][h] = _mm256_add_ps(_mm256_add_ps(a[0][h], a[1][h]), _mm256_add_ps(a[2][h], a[3][h]));
    tile_int8(1, x, K, panel, k, K, acc);
}

/* A tile's MT rows, packed ([k][MT]: xt), times widened columns [0, kc) of a panel in `buf` ([kc][PANEL]). */
static inline __attribute__((always_inline)) void tile_float(const int MT, const float *xt, const float *buf,
                                                             int64_t kc, __m256 acc[MR][2]) {
    __m256 a[MR][2];  /* as in tile_int8 */
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

static inline void zero(__m256 acc[MR][2]) {
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
}

/* y[i, n0 + j] (j < width) = acc * scale (+ r); `add`: onto what y holds. */
static void store(int MT, __m256 acc[MR][2], const float *scale, const float *r, float *y, int64_t N, int width,
                  int add) {
    float out[PANEL];
    for (int i = 0; i < MT; i++) {
        _mm256_storeu_ps(out, acc[i][0]);
        _mm256_storeu_ps(out + 8, acc[i][1]);
        for (int j = 0; j < width; j++) {
            float v = scale ? out[j] * scale[j] : out[j];
            if (add) v += y[i * N + j];
            else if (r) v += r[i * N + j];
            y[i * N + j] = v;
        }
    }
}

#define SWITCH_MT(MT, CALL) \
    switch (MT) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
                  case 4: CALL(4); break; case 5: CALL(5); break; default: CALL(6); break; }

/* One panel, every row. `xp`: x packed by pack_rows (more than MR rows); `buf`: KC * PANEL floats of this
 * thread's. */
static void panel_rows(const float *x, const float *xp, int64_t M, int64_t K, const int8_t *panel,
                       const float *scale, int width, const float *r, float *y, int64_t N, float *buf) {
    __m256 acc[MR][2];
    if (M <= MR) {  /* one tile: widen in registers as the panel streams past */
        zero(acc);
        if (M == 1) row_int8(x, K, panel, acc);
        else {
#define TILE(T) tile_int8(T, x, K, panel, 0, K, acc)
            SWITCH_MT(M, TILE)
#undef TILE
        }
        store((int)M, acc, scale, r, y, N, width, 0);
        return;
    }
    float s[PANEL];
    for (int j = 0; j < PANEL; j++) s[j] = j < width ? scale[j] : 0.0f;
    __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t kc = K - k0 < KC ? K - k0 : KC;
        for (int64_t k = 0; k < kc; k++) {  /* widen and scale once for all rows */
            if (k % 4 == 0) __builtin_prefetch(panel + (k0 + k + AHEAD) * PANEL);
            _mm256_storeu_ps(buf + k * PANEL, _mm256_mul_ps(widen(panel + (k0 + k) * PANEL), s0));
            _mm256_storeu_ps(buf + k * PANEL + 8, _mm256_mul_ps(widen(panel + (k0 + k) * PANEL + 8), s1));
        }
        for (int64_t m = 0; m < M; m += MR) {
            int mt = M - m < MR ? (int)(M - m) : MR;
            zero(acc);
#define TILE(T) tile_float(T, xp + m * K + k0 * mt, buf, kc, acc)
            SWITCH_MT(mt, TILE)
#undef TILE
            store(mt, acc, 0, r ? r + m * N : 0, y + m * N, N, width, k0 > 0);
        }
    }
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
/* Plain C: one panel, every row, the weights widened as they are read. */
static void panel_rows(const float *x, const float *xp, int64_t M, int64_t K, const int8_t *panel,
                       const float *scale, int width, const float *r, float *y, int64_t N, float *buf) {
    (void)xp, (void)buf;
    for (int64_t m = 0; m < M; m++) {
        float acc[PANEL] = {0};
        for (int64_t k = 0; k < K; k++) {
            float b = x[m * K + k];
            for (int j = 0; j < PANEL; j++) acc[j] += b * (float)panel[k * PANEL + j];
        }
        for (int j = 0; j < width; j++) y[m * N + j] = acc[j] * scale[j] + (r ? r[m * N + j] : 0.0f);
    }
}
#endif

/* x [M, K], packed (int8_pack) weights, s [N], r [M, N] or NULL, y [M, N]; all contiguous. The panels are split
 * among `threads` threads. Returns 0, or -1 where the scratch for the rows could not be had. */
int int8_linear(const float *x, int64_t M, int64_t K, const int8_t *packed, const float *s, int64_t N,
                const float *r, float *y, int threads) {
    int64_t panels = (N + PANEL - 1) / PANEL;
    float *xp = 0;
#ifdef HAVE_AVX2
    if (M > MR && !(xp = malloc((size_t)(M * K) * sizeof(float)))) return -1;
#endif
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
            panel_rows(x, xp, M, K, packed + p * K * PANEL, s + n, width, r ? r + n : 0, y + n, N, buf);
        }
    }
    free(xp);
    return 0;
}
