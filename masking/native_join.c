/* Sessions' segments joined end to end and split back on the CPU (masking/sessions.py, issue 54).
 *
 * Row-major arrays. A (rows, cols) source row r holds lengths[r] leading elements (the rest is PAD);
 * in the joined buffer they start at element offsets[r] (session * width + the session's earlier
 * segments' lengths). Each copy is one memcpy per row: a pass over the bytes, no index tensor.
 *
 * join_rows: copy each row's leading elements to the joined buffer, then set every joined row's tail
 * (from totals[s], its joined length, to width) to the byte fill (0, or 0xFF: -1 in any integer type).
 * join_turn_ids: the same for turn ids (int16 or int64, turn_kind 2 or 8), adding add[r] to each
 * (the turns of the session's earlier segments). split_rows: the inverse, each row's leading elements
 * read back and its tail zeroed (0 in every float and integer type). */
#include <stdint.h>
#include <string.h>

void join_rows(const char *src, char *dst, int64_t elem, int64_t rows, int64_t cols, const int64_t *lengths,
               const int64_t *offsets, int64_t sessions, int64_t width, const int64_t *totals, int fill) {
    for (int64_t r = 0; r < rows; r++)
        memcpy(dst + offsets[r] * elem, src + r * cols * elem, (size_t)(lengths[r] * elem));
    for (int64_t s = 0; s < sessions; s++)
        memset(dst + (s * width + totals[s]) * elem, fill, (size_t)((width - totals[s]) * elem));
}

void join_turn_ids(const void *src, void *dst, int turn_kind, int64_t rows, int64_t cols, const int64_t *lengths,
                   const int64_t *offsets, const int64_t *add, int64_t sessions, int64_t width,
                   const int64_t *totals) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t n = lengths[r], a = add[r];
        if (turn_kind == 2) {
            const int16_t *in = (const int16_t *)src + r * cols;
            int16_t *out = (int16_t *)dst + offsets[r];
            for (int64_t c = 0; c < n; c++) out[c] = (int16_t)(in[c] + a);
        } else {
            const int64_t *in = (const int64_t *)src + r * cols;
            int64_t *out = (int64_t *)dst + offsets[r];
            for (int64_t c = 0; c < n; c++) out[c] = in[c] + a;
        }
    }
    char *bytes = (char *)dst;
    for (int64_t s = 0; s < sessions; s++)
        memset(bytes + (s * width + totals[s]) * turn_kind, 0xFF, (size_t)((width - totals[s]) * turn_kind));
}

void split_rows(const char *joined, char *dst, int64_t elem, int64_t rows, int64_t cols, const int64_t *lengths,
                const int64_t *offsets) {
    for (int64_t r = 0; r < rows; r++) {
        memcpy(dst + r * cols * elem, joined + offsets[r] * elem, (size_t)(lengths[r] * elem));
        memset(dst + (r * cols + lengths[r]) * elem, 0, (size_t)((cols - lengths[r]) * elem));
    }
}

/* row_lengths: each row's tokens before its trailing PAD (0), read from the row's end. row_turns: each
 * row's ASSISTANT (1) runs among its first lengths[r] tokens. spans: int8 (rows, cols). */
void row_lengths(const int8_t *spans, int64_t rows, int64_t cols, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t n = cols;
        while (n > 0 && spans[r * cols + n - 1] == 0) n--;
        out[r] = n;
    }
}

void row_turns(const int8_t *spans, int64_t rows, int64_t cols, const int64_t *lengths, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const int8_t *row = spans + r * cols;
        int64_t runs = 0;
        int previous = 0;
        for (int64_t c = 0; c < lengths[r]; c++) {
            int assistant = row[c] == 1;
            runs += assistant & !previous;
            previous = assistant;
        }
        out[r] = runs;
    }
}
