/* Every decoder layer of a decode step in one call, for a Llama-architecture model whose products are int8 by our
 * kernel: the same kernels the lean forward calls one by one from Python (int8_linear.c, decode_attention.c,
 * layer_ops.c, built into this library as one unit), in the same order on the same buffers, so the results are
 * the same bit for bit.
 *
 * Why: at one decode row each of a layer's nine calls does a few microseconds of work, and reaching it from Python
 * (the wrapper, ctypes' conversions, a tensor for its output) cost about as much again: some 270 calls, about
 * 3 ms of a 9.7 ms step of SmolLM2-135M on 2 cores. Here that is one call a step.
 */
#include "int8_linear.c"
#include "decode_attention.c"
#include "layer_ops.c"

/* One layer's weights and cache, as the addresses and sizes of `table`'s row (int64 each, in this order). */
/* Each product: its packed weights, its output channels and its bits a code. */
enum { INPUT_NORM, QKV, QKV_OUT, QKV_BITS, O, O_OUT, O_BITS, POST_NORM, GATE_UP, GATE_UP_OUT, GATE_UP_BITS, DOWN,
       DOWN_OUT, DOWN_BITS, K_CACHE, V_CACHE, LAYER_FIELDS };

#define AT(type, field) ((type)(intptr_t)row[field])

/* h [rows][hidden] (each row one decode's hidden state) through `layers` layers, in place. table [layers]
 * [LAYER_FIELDS]; cos, sin [rows][d] (sin signed as layer_ops.c's rotate wants); slots [rows]; tables [rows]
 * [max_blocks]; lengths [rows] (after this step's token). Returns 0, or -1 where memory could not be had. */
int decode_layers(float *h, int64_t rows, const int64_t *table, int layers, int hidden, int heads, int kv_heads,
                  int d, int intermediate, int block_size, float eps, float scale, const float *cos,
                  const float *sin, const int64_t *slots, const int64_t *tables, int64_t max_blocks,
                  const int64_t *lengths, int threads) {
    int64_t qkv_width = (int64_t)(heads + 2 * kv_heads) * d, attn_width = (int64_t)heads * d;
    if (rows <= 0) return 0;
    float *x = malloc(sizeof(float) * (size_t)(rows * hidden));
    float *qkv = malloc(sizeof(float) * (size_t)(rows * qkv_width));
    float *q = malloc(sizeof(float) * (size_t)(rows * attn_width));
    float *attn = malloc(sizeof(float) * (size_t)(rows * attn_width));
    float *gate_up = malloc(sizeof(float) * (size_t)(rows * 2 * intermediate));
    float *act = malloc(sizeof(float) * (size_t)(rows * intermediate));
    int failed = !x || !qkv || !q || !attn || !gate_up || !act;
    for (int l = 0; l < layers && !failed; l++) {
        const int64_t *row = table + (int64_t)l * LAYER_FIELDS;
        rms_norm(h, hidden, rows, hidden, AT(const float *, INPUT_NORM), eps, x, threads);
        failed |= int8_linear(x, rows, hidden, AT(const uint8_t *, QKV), row[QKV_OUT], (int)row[QKV_BITS], 0, qkv,
                              threads);
        rope_store(qkv, rows, heads, kv_heads, d, cos, sin, slots, q, AT(float *, K_CACHE), AT(float *, V_CACHE),
                   threads);
        failed |= decode_attention(q, attn_width, AT(const float *, K_CACHE), AT(const float *, V_CACHE), tables,
                                   max_blocks, lengths, rows, heads, kv_heads, d, block_size, scale, attn, threads);
        /* h += o(attn): each element's residual is read before it is written */
        failed |= int8_linear(attn, rows, attn_width, AT(const uint8_t *, O), row[O_OUT], (int)row[O_BITS], h, h,
                              threads);
        rms_norm(h, hidden, rows, hidden, AT(const float *, POST_NORM), eps, x, threads);
        failed |= int8_linear(x, rows, hidden, AT(const uint8_t *, GATE_UP), row[GATE_UP_OUT], (int)row[GATE_UP_BITS], 0,
                              gate_up, threads);
        silu_mul(gate_up, rows, intermediate, act, threads);
        failed |= int8_linear(act, rows, intermediate, AT(const uint8_t *, DOWN), row[DOWN_OUT], (int)row[DOWN_BITS], h, h,
                              threads);
    }
    free(x);
    free(qkv);
    free(q);
    free(attn);
    free(gate_up);
    free(act);
    return failed ? -1 : 0;
}
