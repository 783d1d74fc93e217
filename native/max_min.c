/* The simulator's max-min fair rates with a rate lag, in one call.
 *
 * prophet_tf/bench/simulate_max_min.py's `levels` and simulate_rate_lag.py's
 * `_fill_levels` do the same in numpy: the progressive filling is about 25
 * rounds of a few array operations on ~130 links, so a computation costs
 * mostly numpy's per-call overhead (simulate_max_min.py says why the rounds
 * are what they are). This file is their loop in C, loaded with ctypes
 * (prophet_tf/bench/max_min_native.py): plain C, no Python API, so the wheel
 * stays tied to no Python ABI.
 *
 * The sums go in numpy's order (slot order; rows in order; numpy's pairwise
 * sum along a row), so the results have numpy's bits, except in a round where
 * several links are full at once: numpy takes `fixed @ crossing` from BLAS,
 * whose order is its own; here the full links are added in link order.
 *
 * Every index read from the caller is checked before it is used to write:
 * a flow's link outside [0, n) returns an error and writes nothing.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Links whose shares are this close to the least are full in the same round
 * (simulate_max_min._TIES). */
#define TIES 1e-9
/* The level of a link that limits no flow (simulate_max_min.NO_LEVEL). */
#define NO_LEVEL 1e300

enum { MAX_MIN_OK = 0, MAX_MIN_BAD_ARGUMENT = 1, MAX_MIN_BAD_LINK = 2, MAX_MIN_NO_MEMORY = 3 };

/* numpy's pairwise summation of n doubles (its DOUBLE_pairwise_sum): eight
 * running sums up to 128 values, halves (cut at a multiple of 8) above. */
static double pairwise_sum(const double *a, int64_t n) {
    if (n < 8) {
        double res = 0.0;
        for (int64_t i = 0; i < n; i++) res += a[i];
        return res;
    }
    if (n <= 128) {
        double r[8];
        for (int k = 0; k < 8; k++) r[k] = a[k];
        int64_t i;
        for (i = 8; i < n - (n % 8); i += 8)
            for (int k = 0; k < 8; k++) r[k] += a[i + k];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

/* np.maximum(x, 0.0): x unless below 0 (a nan stays nan), inline (libm's
 * fmax is a call, and turns a nan into 0). */
static inline double at_least_zero(double x) { return (isnan(x) || x >= 0.0) ? x : 0.0; }

/* The weight of the flows crossing links a and b, either way round: numpy's
 * `pairs + pairs.T`, taken where it is needed rather than built whole. */
static inline double crossing(const double *pairs, int64_t n, int64_t a, int64_t b) {
    return pairs[a * n + b] + pairs[b * n + a];
}

/* Each link's level (rate per unit of weight of the flows it limits) by
 * progressive filling; simulate_max_min.levels, whose docstring has the
 * method. `pairs[a * n + b]` is the weight of the flows whose first link is a
 * and second b; `left`, `weight` are changed. */
static void fill_levels(int64_t n, const double *pairs, double *left, double *weight,
                        double *level, double *share, int64_t *full) {
    for (int64_t l = 0; l < n; l++) {
        level[l] = NO_LEVEL;
        if (weight[l] <= 0) left[l] = INFINITY;
    }
    for (;;) {
        double least = INFINITY;
        for (int64_t l = 0; l < n; l++) {
            share[l] = left[l] / weight[l];
            if (share[l] < least) least = share[l];  /* fmin: a nan is passed over */
        }
        if (least == INFINITY) return;
        int64_t count = 0;
        double bound = least * (1 + TIES);
        for (int64_t l = 0; l < n; l++)
            if (share[l] <= bound) full[count++] = l;
        for (int64_t k = 0; k < count; k++) {
            level[full[k]] = share[full[k]];
            left[full[k]] = INFINITY;
        }
        for (int64_t j = 0; j < n; j++) {
            double taken = 0.0, limited = 0.0;
            if (count == 1) {
                limited = crossing(pairs, n, full[0], j);
                taken = limited * share[full[0]];
            } else {
                for (int64_t k = 0; k < count; k++) {
                    double both = crossing(pairs, n, full[k], j);
                    taken += share[full[k]] * both;
                    limited += both;
                }
            }
            /* Rounding: never below 0, so a link out stays out. */
            left[j] = at_least_zero(left[j] - taken);
            weight[j] = at_least_zero(weight[j] - limited);
        }
    }
}

/* Sets rate[i] for the `used` flows (flow i crosses links first[i] and
 * second[i], 0 for none, with weight[i]) and spare[l] = capacity[l] minus the
 * rates crossing link l, for the n links. Returns MAX_MIN_OK or an error,
 * having written nothing to rate or spare on error. */
int prophet_max_min_rates(int64_t n, const double *capacity, int64_t used,
                          const int64_t *first, const int64_t *second, const double *weight,
                          double *rate, double *spare) {
    if (n <= 0 || used < 0 || n > (int64_t)1 << 20) return MAX_MIN_BAD_ARGUMENT;
    for (int64_t i = 0; i < used; i++)
        if (first[i] < 0 || first[i] >= n || second[i] < 0 || second[i] >= n)
            return MAX_MIN_BAD_LINK;
    double *pairs = calloc((size_t)(n * n), sizeof(double));
    double *scratch = calloc((size_t)(7 * n), sizeof(double));
    int64_t *full = calloc((size_t)n, sizeof(int64_t));
    if (!pairs || !scratch || !full) {
        free(pairs); free(scratch); free(full);
        return MAX_MIN_NO_MEMORY;
    }
    double *left = scratch, *link_weight = scratch + n, *level = scratch + 2 * n;
    double *share = scratch + 3 * n, *column = scratch + 4 * n;
    double *load_first = scratch + 5 * n, *load_second = scratch + 6 * n;
    /* Per pair of links, the weight of the flows crossing both, in slot
     * order (np.bincount). */
    for (int64_t i = 0; i < used; i++) pairs[first[i] * n + second[i]] += weight[i];
    /* Each link's weight: the column sums (rows added in order) plus the
     * row sums (pairwise). */
    for (int64_t j = 0; j < n; j++) column[j] = pairs[j];
    for (int64_t i = 1; i < n; i++)
        for (int64_t j = 0; j < n; j++) column[j] += pairs[i * n + j];
    for (int64_t l = 0; l < n; l++) {
        link_weight[l] = column[l] + pairwise_sum(pairs + l * n, n);
        left[l] = capacity[l];
    }
    fill_levels(n, pairs, left, link_weight, level, share, full);
    for (int64_t l = 0; l < n; l++) load_first[l] = load_second[l] = 0.0;
    for (int64_t i = 0; i < used; i++) {
        double a = level[first[i]], b = level[second[i]];
        rate[i] = weight[i] * (a < b ? a : b);
        load_first[first[i]] += rate[i];
    }
    for (int64_t i = 0; i < used; i++) load_second[second[i]] += rate[i];
    for (int64_t l = 0; l < n; l++) spare[l] = capacity[l] - (load_first[l] + load_second[l]);
    free(pairs); free(scratch); free(full);
    return MAX_MIN_OK;
}
