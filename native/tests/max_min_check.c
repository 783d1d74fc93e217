/* Checks native/max_min.c under AddressSanitizer and UBSan
 * (tests/unit/test_max_min_native.py builds and runs it): random links and
 * flows, up to 3000 flows on up to 200 links; every flow limited by a full
 * link, no link over its capacity, and a flow on a link out of range refused
 * with nothing written. Exit status 0: all cases passed. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int prophet_max_min_rates(int64_t n, const double *capacity, int64_t used,
                          const int64_t *first, const int64_t *second, const double *weight,
                          double *rate, double *spare);

static uint64_t state = 88172645463325252ull;
static uint64_t next(void) {  /* xorshift64 */
    state ^= state << 13; state ^= state >> 7; state ^= state << 17;
    return state;
}
static double uniform(void) { return (double)(next() >> 11) / 9007199254740992.0; }

static int fail(int c, const char *what) {
    fprintf(stderr, "case %d: %s\n", c, what);
    return 1;
}

int main(void) {
    enum { CASES = 2000 };
    for (int c = 0; c < CASES; c++) {
        int64_t n = 2 + (int64_t)(next() % 199), used = (int64_t)(next() % 3001);
        double *capacity = malloc((size_t)n * sizeof(double));
        double *spare = malloc((size_t)n * sizeof(double));
        int64_t *first = malloc((size_t)(used + 1) * sizeof(int64_t));
        int64_t *second = malloc((size_t)(used + 1) * sizeof(int64_t));
        double *weight = malloc((size_t)(used + 1) * sizeof(double));
        double *rate = malloc((size_t)(used + 1) * sizeof(double));
        if (!capacity || !spare || !first || !second || !weight || !rate) return fail(c, "malloc");
        capacity[0] = INFINITY;
        for (int64_t l = 1; l < n; l++) capacity[l] = c % 3 ? 1.0 + 99.0 * uniform() : 50.0;
        for (int64_t i = 0; i < used; i++) {
            first[i] = 1 + (int64_t)(next() % (uint64_t)(n - 1));
            second[i] = next() % 5 ? 1 + (int64_t)(next() % (uint64_t)(n - 1)) : 0;
            weight[i] = next() % 10 ? (c % 2 ? exp(2.0 * uniform() - 1.0) : 1.0) : 0.0;
        }
        if (prophet_max_min_rates(n, capacity, used, first, second, weight, rate, spare))
            return fail(c, "refused a valid case");
        for (int64_t l = 1; l < n; l++)
            if (spare[l] < -1e-9 * capacity[l]) return fail(c, "a link over its capacity");
        for (int64_t i = 0; i < used; i++) {
            if (weight[i] == 0.0) {
                if (rate[i] != 0.0) return fail(c, "a free slot with a rate");
                continue;
            }
            int limited = 0;
            for (int k = 0; k < 2; k++) {
                int64_t l = k ? second[i] : first[i];
                if (l && spare[l] <= 1e-9 * capacity[l]) limited = 1;
            }
            if (!limited || !(rate[i] > 0.0)) return fail(c, "a flow limited by no full link");
        }
        /* A flow on link n (one past the last): refused, nothing written. */
        first[used] = n; second[used] = 0; weight[used] = 1.0;
        for (int64_t i = 0; i <= used; i++) rate[i] = -1.0;
        for (int64_t l = 0; l < n; l++) spare[l] = -1.0;
        if (prophet_max_min_rates(n, capacity, used + 1, first, second, weight, rate, spare) != 2)
            return fail(c, "accepted a link out of range");
        for (int64_t i = 0; i <= used; i++) if (rate[i] != -1.0) return fail(c, "wrote a rate");
        for (int64_t l = 0; l < n; l++) if (spare[l] != -1.0) return fail(c, "wrote a spare");
        free(capacity); free(spare); free(first); free(second); free(weight); free(rate);
    }
    if (prophet_max_min_rates(0, NULL, 0, NULL, NULL, NULL, NULL, NULL) != 1)
        return fail(-1, "accepted no links");
    printf("%d cases passed\n", CASES);
    return 0;
}
