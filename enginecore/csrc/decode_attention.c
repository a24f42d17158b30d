/* Paged attention of decode rows on the CPU: each row's one query against its context, read where it lies in
 * the paged KV cache (no gather), in float32.
 *
 * Why our own: torch's path copies every row's context out of the cache (two index_selects), pads it to the
 * longest row and masks the padding, then runs SDPA: at one row of 64 tokens that was about 100 us a layer
 * (the copies, the mask, SDPA's own set-up), 3 ms of a 17 ms step of SmolLM2-135M on 2 cores; here it is a
 * few microseconds. At many rows the copies moved each row's K and V twice more than the attention reads them.
 *
 * For row b and KV head g, the query heads of g's group (heads / kv_heads of them) take their scores over the
 * row's `length` tokens (each K row read once for the group, four tokens at a time), a softmax, and the
 * weighted sum of V (32 floats of the output in registers over all tokens), in three passes over a scratch row
 * of scores; rows x KV heads are split among the threads. GCC/Clang vector extensions (8 floats), which the compiler maps
 * to AVX2, AVX-512 or NEON; exp by a polynomial of the same vectors (Cephes' expf: relative error ~1e-7).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec8.h"

/* scores[j][t0 + u] = q_j . k[u] * scale for the group's heads j and n <= 4 tokens whose K rows are k[0..n):
 * each K row is read once for all heads of the group, and four dot products run side by side (one alone
 * would wait on its own sums). */
static inline void scores4(const float *q, const float *const k[4], int n, int group, int d, float scale,
                           float *scores, int64_t t0, int64_t length) {
    for (int j = 0; j < group; j++) {
        const float *qj = q + (int64_t)j * d;
        v8f a0 = splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
        int c = 0;
        for (; c + 8 <= d; c += 8) {
            v8f qv = load8(qj + c);
            a0 += qv * load8(k[0] + c);
            a1 += qv * load8(k[1] + c);
            a2 += qv * load8(k[2] + c);
            a3 += qv * load8(k[3] + c);
        }
        float s[4] = {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3)};
        for (; c < d; c++)
            for (int u = 0; u < 4; u++) s[u] += qj[c] * k[u][c];
        for (int u = 0; u < n; u++) scores[j * length + t0 + u] = s[u] * scale;
    }
}

/* scores[j][:] -> softmax, in place. */
static void softmax(float *s, int64_t length) {
    float max = -INFINITY;
    for (int64_t t = 0; t < length; t++) max = s[t] > max ? s[t] : max;
    v8f sum8 = splat(0.0f);
    int64_t t = 0;
    for (; t + 8 <= length; t += 8) {
        v8f e = exp8(load8(s + t) - splat(max));
        store8(s + t, e);
        sum8 += e;
    }
    float sum = hsum8(sum8);
    for (; t < length; t++) {
        s[t] = expf(s[t] - max);
        sum += s[t];
    }
    float inv = 1.0f / sum;
    for (t = 0; t < length; t++) s[t] *= inv;
}

/* Where a row's context lies: its block table, and for KV head g the offset and token stride in a block. */
typedef struct {
    const int64_t *table;
    int64_t length, stride, head;
    int block_size;
} Context;

/* The K or V rows of tokens [t, t + n) of the block that holds t, n tokens at most to its end; returns n. */
static inline int64_t rows_of_block(const float *cache, const Context *cx, int64_t t, int64_t n, const float **first) {
    int64_t in_block = t % cx->block_size, left = cx->block_size - in_block;
    *first = cache + (cx->table[t / cx->block_size] * cx->block_size + in_block) * cx->stride + cx->head;
    return n < left ? n : left;
}

/* out[c0 .. c0 + 8 * W) of one head = sum_t p[t] * v_t[...]: W vectors kept in registers over the tokens. */
#define WEIGHTED_SUM(W)                                                                                     \
    static inline void weighted_sum_##W(const float *p, const float *v_cache, const Context *cx, int c0,    \
                                        float *out) {                                                       \
        v8f o[W];                                                                                           \
        for (int w = 0; w < W; w++) o[w] = splat(0.0f);                                                     \
        for (int64_t t = 0; t < cx->length;) {                                                              \
            const float *v;                                                                                 \
            int64_t n = rows_of_block(v_cache, cx, t, cx->length - t, &v);                                  \
            for (int64_t i = 0; i < n; i++, v += cx->stride) {                                              \
                v8f pt = splat(p[t + i]);                                                                   \
                for (int w = 0; w < W; w++) o[w] += pt * load8(v + c0 + 8 * w);                             \
            }                                                                                               \
            t += n;                                                                                         \
        }                                                                                                   \
        for (int w = 0; w < W; w++) store8(out + c0 + 8 * w, o[w]);                                        \
    }
WEIGHTED_SUM(4)
WEIGHTED_SUM(1)

/* One row's query heads of KV head g (the group's `group` heads, d floats each, contiguous). scores: group *
 * length floats. */
static void attend(const float *q, const float *k_cache, const float *v_cache, const Context *cx, int group,
                   int d, float scale, float *scores, float *out) {
    int64_t length = cx->length;
    for (int64_t t = 0; t < length;) {
        const float *k;
        int64_t n = rows_of_block(k_cache, cx, t, length - t, &k);
        for (int64_t i = 0; i < n; i += 4) {
            int m = n - i < 4 ? (int)(n - i) : 4;
            const float *rows[4];
            for (int u = 0; u < 4; u++) rows[u] = k + (i + (u < m ? u : 0)) * cx->stride;
            scores4(q, rows, m, group, d, scale, scores, t + i, length);
        }
        t += n;
    }
    for (int j = 0; j < group; j++) softmax(scores + j * length, length);
    for (int j = 0; j < group; j++) {
        const float *p = scores + j * length;
        float *o = out + (int64_t)j * d;
        int c = 0;
        for (; c + 32 <= d; c += 32) weighted_sum_4(p, v_cache, cx, c, o);
        for (; c + 8 <= d; c += 8) weighted_sum_1(p, v_cache, cx, c, o);
        for (; c < d; c++) {
            float sum = 0.0f;
            for (int64_t t = 0; t < length;) {
                const float *v;
                int64_t n = rows_of_block(v_cache, cx, t, length - t, &v);
                for (int64_t i = 0; i < n; i++) sum += p[t + i] * v[i * cx->stride + c];
                t += n;
            }
            o[c] = sum;
        }
    }
}

/* q: [rows][heads][d] floats, row b at q + b * q_stride (heads contiguous); k_cache, v_cache: one layer's
 * [blocks][block_size][kv_heads][d]; tables: [rows][max_blocks] block ids; lengths: [rows] context lengths
 * (>= 1); out: [rows][heads][d]. Returns 0, or -1 where the scratch could not be had. */
int decode_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                     const int64_t *tables, int64_t max_blocks, const int64_t *lengths, int64_t rows, int heads,
                     int kv_heads, int d, int block_size, float scale, float *out, int threads) {
    int group = heads / kv_heads;
    int64_t longest = 1, work = 0;
    if (rows <= 0) return 0;
    for (int64_t b = 0; b < rows; b++) {
        longest = lengths[b] > longest ? lengths[b] : longest;
        work += lengths[b];
    }
    int failed = 0;
    /* threads only where there is enough to share: a parallel region's start and join cost some microseconds, which
     * a few thousand token-heads' work pays for (a round figure, not tuned) */
#pragma omp parallel num_threads(threads) if (threads > 1 && rows * kv_heads > 1 && work * heads >= 4096)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * longest));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t unit = 0; unit < rows * kv_heads; unit++) {
            if (!scores) continue;
            int64_t b = unit / kv_heads;
            int g = (int)(unit % kv_heads);
            Context cx = {tables + b * max_blocks, lengths[b], (int64_t)kv_heads * d, (int64_t)g * d, block_size};
            attend(q + b * q_stride + (int64_t)g * group * d, k_cache, v_cache, &cx, group, d, scale, scores,
                   out + (b * heads + (int64_t)g * group) * d);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
