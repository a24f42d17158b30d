/* The 8-bit codes of a float32 weight in int8_linear.c's format: for each output channel's block of BK columns,
 * w ~= scale * code + offset, the offset the block's least weight (enginecore/cpu_int8.block_codes says why).
 *
 * A block that lies on one of a GGUF's grids (Q4_1's 16 values from its minimum, a step of its range / 15; Q5_1's
 * 32, range / 31; Q8_0's d x (-127 .. 127), the largest |w| / 127; Q4_0's and Q5_0's d x (-8 .. 7) and
 * (-16 .. 15)) within 1% of a step takes the grid's codes and the step fitted to all of its weights (least
 * squares), so its weights come back as they were, up to float rounding. Any other block has its range cut in 255
 * equal steps. Each grid is tried on the block's first CODE_SAMPLE columns, and on the whole block only if those
 * pass: a block off a grid is nearly always off it there too.
 *
 * Why in C: made in torch's tensor operations (the same steps, whole weights at once), the codes came at about
 * 115M weights a second on 2 cores: 10 s for a 1.2B model, over a minute for an 8B one, at every start. This is
 * one pass over each block while it sits in the L1 cache; included by int8_linear.c, so one library has both.
 * The operations are float32's in the same order as a tensor program would make them (a division by the step, a
 * rounding to the nearest even), so the codes equal those of tests/test_cpu_int8.py's reference in torch.
 */
#include <math.h>
#include <stdint.h>

#define CODE_GRIDS 5
#define CODE_SAMPLE 4       /* columns of a block each grid is tried on first */
#define GRID_SLACK 0.01f    /* how far from a whole step a weight on a grid may be, in steps */

/* Whether above[0 .. n) (a block's weights less its least) lie on the grid of `step`: 0 .. 255 steps, each within
 * GRID_SLACK of a whole step. */
static int on_grid(const float *above, int n, float step) {
    for (int i = 0; i < n; i++) {
        float steps = above[i] / step;
        if (!(steps < 255.5f) || !(fabsf(steps - rintf(steps)) < GRID_SLACK))
            return 0;
    }
    return 1;
}

/* One block of n <= BK weights: its codes, scale and offset. Comparisons, not fminf and fmaxf (calls into libm,
 * two per weight), and the codes' loop with nothing else in it, which the compiler vectorizes: 8.9 -> 1.9 ns a
 * weight on one core of a 2-core AMD EPYC Zen 2 (one-off, a 2048 x 8192 weight). */
static void code_block(const float *w, int n, uint8_t *codes, float *scale, float *offset) {
    float least = w[0], largest = w[0];
    for (int i = 1; i < n; i++) {
        least = w[i] < least ? w[i] : least;
        largest = w[i] > largest ? w[i] : largest;
    }
    float above[BK];
    for (int i = 0; i < n; i++)
        above[i] = w[i] - least;
    float span = largest - least, most = fabsf(least) > fabsf(largest) ? fabsf(least) : fabsf(largest);
    float step = span / 255.0f;
    int on_a_grid = 0;
    if (span > 0) { /* a block of one value keeps step 0: every code 0 */
        const float grids[CODE_GRIDS] = {span / 15.0f, span / 31.0f, most / 127.0f, most / 8.0f, most / 16.0f};
        for (int g = 0; g < CODE_GRIDS && !on_a_grid; g++)
            if (on_grid(above, n < CODE_SAMPLE ? n : CODE_SAMPLE, grids[g]) && on_grid(above, n, grids[g])) {
                step = grids[g];
                on_a_grid = 1;
            }
    }
    float divisor = step > 0 ? step : 1.0f;
    float code[BK];
    for (int i = 0; i < n; i++) {
        float c = rintf(above[i] / divisor);
        code[i] = c > 0 ? (c < 255 ? c : 255) : 0; /* and NaN (a weight that is not a number) to 0 */
        codes[i] = (uint8_t)code[i];
    }
    *offset = least;
    *scale = step;
    if (on_a_grid) { /* the step fitted to all of its codes (least squares): one weight's rounding does not set it */
        double cross = 0, square = 0;
        for (int i = 0; i < n; i++) {
            cross += (double)code[i] * above[i];
            square += (double)code[i] * code[i];
        }
        *scale = (float)(cross / (square > 1 ? square : 1));
    }
}

/* w [N, K] float32 -> codes [N, K], scale and offset [N, ceil(K / BK)]; all contiguous. Rows split among
 * `threads` OpenMP threads. */
void int8_codes(const float *w, int64_t N, int64_t K, uint8_t *codes, float *scale, float *offset, int threads) {
    int64_t blocks = (K + BK - 1) / BK;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t k = b * BK;
            code_block(w + n * K + k, (int)(K - k < BK ? K - k : BK), codes + n * K + k, scale + n * blocks + b,
                        offset + n * blocks + b);
        }
}
