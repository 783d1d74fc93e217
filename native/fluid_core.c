/* The simulator's event queue and its links with a rate lag, compiled.
 *
 * prophet_tf/bench/simulate_events.py (the queue) and simulate_rate_lag.py
 * (the flows' rates, late by up to rate_lag_s) in one CPython extension type,
 * `Core`, which prophet_tf/bench/simulate_compiled.py subclasses. At 64
 * workers the simulation runs millions of events and flow starts and ends;
 * in Python their bookkeeping (heaps, slots, the pending flow end) cost more
 * than the workers' and the engine's own code. Here an event costs a call of
 * its Python callback and little else.
 *
 * Every step is the Python path's, with the same float operations in the
 * same order (built with -ffp-contract=off: no fused multiply-adds), the same
 * slot numbers (a stack of free slots) and the same order of events (time,
 * then place in the queue), so a simulation gives the same results to the
 * last bit (tests/unit/test_simulate_compiled.py compares the two). The rates
 * come from native/max_min.c's prophet_max_min_rates, as in Python.
 *
 * Built against the stable ABI of Python 3.11 (abi3): one build serves every
 * Python the package supports. Every write into an array is at an index
 * checked against its size (the arrays grow before they are written).
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int prophet_max_min_rates(int64_t n, const double *capacity, int64_t used,
                          const int64_t *first, const int64_t *second, const double *weight,
                          double *rate, double *spare);

typedef struct { double t; int64_t seq; PyObject *fn; } Event;  /* fn: owned */
typedef struct { double t; int64_t seq; int64_t slot; } Late;   /* a flow started since */

typedef struct {
    PyObject_HEAD
    int ready;
    double now, rate_lag, last;
    int64_t seq;             /* the place of the latest event queued */
    Event *events;           /* heap of (time, place, fn), time > now when queued */
    int64_t n_events, cap_events;
    Event *instant;          /* ring of (place, fn) at now, first in first out */
    int64_t instant_head, n_instant, cap_instant;
    double *capacity, *spare;  /* per link id; 0 is no link (inf) */
    int64_t n_links, cap_capacity, cap_spare;
    /* Per flow slot: bytes left (as of `last`), rate, weight (0: free),
     * links (second 0: none), start order, done callback (NULL: free). */
    double *remaining, *rate, *weight;
    int64_t *first, *second, *flow_seq;
    PyObject **done;
    int64_t n_slots, slots_used;
    int64_t *free_slots, n_free;
    int64_t flows_started;
    Late *late;              /* heap of the flows started since the rates */
    int64_t n_late, cap_late;
    double *end_times;       /* the flows that end before the next rates, by end */
    int64_t *end_slots, n_end, end_next, cap_end_times, cap_end_slots;
    int refill_due;          /* the rates are due at refill_at */
    double refill_at;
    double end_at, end_time; /* the pending flow end: unclamped, and in the queue */
    int64_t end_place;
} Core;

/* -- growing arrays: every write goes through a size checked here ----------------- */

static int grow(void **array, int64_t *cap, int64_t need, size_t item) {
    if (need <= *cap) return 0;
    int64_t n = *cap ? *cap : 16;
    while (n < need) n *= 2;
    void *p = realloc(*array, (size_t)n * item);
    if (!p) { PyErr_NoMemory(); return -1; }
    *array = p;
    *cap = n;
    return 0;
}

/* -- the two heaps, ordered by (time, place) as Python's tuples are ----------------- */

static inline int before(double t1, int64_t s1, double t2, int64_t s2) {
    return t1 < t2 || (!(t2 < t1) && s1 < s2);
}

#define HEAP_FUNCTIONS(NAME, TYPE)                                                    \
    static void NAME##_up(TYPE *h, int64_t i) {                                       \
        TYPE x = h[i];                                                                \
        while (i > 0) {                                                               \
            int64_t p = (i - 1) / 2;                                                  \
            if (!before(x.t, x.seq, h[p].t, h[p].seq)) break;                         \
            h[i] = h[p];                                                              \
            i = p;                                                                    \
        }                                                                             \
        h[i] = x;                                                                     \
    }                                                                                 \
    static TYPE NAME##_pop(TYPE *h, int64_t *n) {                                     \
        TYPE top = h[0];                                                              \
        TYPE x = h[--*n];                                                             \
        int64_t i = 0;                                                                \
        for (;;) {                                                                    \
            int64_t c = 2 * i + 1;                                                    \
            if (c >= *n) break;                                                       \
            if (c + 1 < *n && before(h[c + 1].t, h[c + 1].seq, h[c].t, h[c].seq)) c++; \
            if (!before(h[c].t, h[c].seq, x.t, x.seq)) break;                         \
            h[i] = h[c];                                                              \
            i = c;                                                                    \
        }                                                                             \
        if (*n) h[i] = x;                                                             \
        return top;                                                                   \
    }

HEAP_FUNCTIONS(event, Event)
HEAP_FUNCTIONS(late, Late)

/* -- the queue ------------------------------------------------------------------------ */

/* Queues fn (a new reference is taken) at time t, after the events queued
 * before for that time. */
static int queue_at(Core *c, double t, PyObject *fn) {
    c->seq++;
    if (t > c->now) {
        if (grow((void **)&c->events, &c->cap_events, c->n_events + 1, sizeof(Event))) return -1;
        c->events[c->n_events] = (Event){t, c->seq, fn};
        Py_INCREF(fn);
        event_up(c->events, c->n_events++);
        return 0;
    }
    if (c->n_instant == c->cap_instant) {  /* unroll the ring into a larger one */
        int64_t cap = c->cap_instant ? 2 * c->cap_instant : 64;
        Event *ring = malloc((size_t)cap * sizeof(Event));
        if (!ring) { PyErr_NoMemory(); return -1; }
        for (int64_t i = 0; i < c->n_instant; i++)
            ring[i] = c->instant[(c->instant_head + i) % c->cap_instant];
        free(c->instant);
        c->instant = ring;
        c->instant_head = 0;
        c->cap_instant = cap;
    }
    c->instant[(c->instant_head + c->n_instant) % c->cap_instant] = (Event){c->now, c->seq, fn};
    c->n_instant++;
    Py_INCREF(fn);
    return 0;
}

/* -- the flows' rates (simulate_rate_lag.py's methods of the same names) ----------- */

static void lagged_change(Core *c) {
    if (!c->refill_due) {
        double due = c->last + c->rate_lag;
        c->refill_at = due > c->now ? due : c->now;
        c->refill_due = 1;
    }
}

static void next_end(Core *c) {
    double a = c->end_next < c->n_end ? c->end_times[c->end_next] : INFINITY;
    double b = c->n_late ? c->late[0].t : INFINITY;
    double t = b < a ? b : a;
    if (t < c->end_at) {
        c->end_at = t;
        c->seq++;
        c->end_time = c->now > t ? c->now : t;
        c->end_place = c->seq;
    }
}

typedef struct { double end; int64_t slot; } Ending;

static int by_end(const void *a, const void *b) {
    const Ending *x = a, *y = b;
    if (x->end < y->end) return -1;
    if (y->end < x->end) return 1;
    return (x->slot > y->slot) - (x->slot < y->slot);  /* stable: slot order */
}

static inline double at_least_zero(double x) { return (isnan(x) || x >= 0.0) ? x : 0.0; }

static int refill(Core *c) {
    double now = c->now;
    c->refill_due = 0;
    c->end_at = c->end_time = INFINITY;
    int64_t used = c->slots_used;
    while (used && !c->done[used - 1]) used--;
    c->slots_used = used;
    double dt = now - c->last;
    for (int64_t i = 0; i < used; i++) c->remaining[i] -= c->rate[i] * dt;
    c->last = now;
    c->n_late = 0;
    c->end_next = 0;
    c->n_end = 0;
    int code = prophet_max_min_rates(c->n_links, c->capacity, used, c->first, c->second,
                                     c->weight, c->rate, c->spare);
    if (code) {
        PyErr_Format(PyExc_RuntimeError, "the max-min rates of %lld links and %lld flow slots "
                     "failed with code %d", (long long)c->n_links, (long long)used, code);
        return -1;
    }
    Ending *soon = malloc((size_t)(used ? used : 1) * sizeof(Ending));
    if (!soon) { PyErr_NoMemory(); return -1; }
    double horizon = now + c->rate_lag, least = INFINITY;
    int64_t n = 0, first_least = -1, any_nan = 0;
    for (int64_t i = 0; i < used; i++) {
        double end = now + at_least_zero(c->remaining[i]) / c->rate[i];
        if (isnan(end)) any_nan = 1;
        else if (end < least) { least = end; first_least = i; }
        if (end <= horizon) soon[n++] = (Ending){end, i};
    }
    /* None before the next rates: the first to end (its end brings them). */
    if (!n && used && !any_nan && least < INFINITY) soon[n++] = (Ending){least, first_least};
    qsort(soon, (size_t)n, sizeof(Ending), by_end);
    if (grow((void **)&c->end_times, &c->cap_end_times, n, sizeof(double)) ||
        grow((void **)&c->end_slots, &c->cap_end_slots, n, sizeof(int64_t))) {
        free(soon);
        return -1;
    }
    for (int64_t i = 0; i < n; i++) {
        c->end_times[i] = soon[i].end;
        c->end_slots[i] = soon[i].slot;
    }
    c->n_end = n;
    free(soon);
    next_end(c);
    return 0;
}

static void remove_flow(Core *c, int64_t slot) {
    c->remaining[slot] = INFINITY;
    c->done[slot] = NULL;
    if (c->n_free < c->n_slots)  /* always: the slot was taken off the free stack */
        c->free_slots[c->n_free++] = slot;
    c->rate[slot] = c->weight[slot] = 0.0;
}

static int by_seq(const void *a, const void *b) {
    int64_t x = ((const int64_t *)a)[0], y = ((const int64_t *)b)[0];
    return (x > y) - (x < y);
}

/* The pending flow end is due: the flows due by now end, in the order they
 * started; their callbacks run after the bookkeeping. */
static int end_now(Core *c) {
    c->end_at = c->end_time = INFINITY;
    double now = c->now;
    int64_t count = 0, cap = 8;
    int64_t (*ended)[2] = malloc((size_t)cap * sizeof *ended);  /* (start order, slot) */
    if (!ended) { PyErr_NoMemory(); return -1; }
    for (;;) {
        int64_t slot;
        if (c->end_next < c->n_end && c->end_times[c->end_next] <= now)
            slot = c->end_slots[c->end_next++];
        else if (c->n_late && c->late[0].t <= now)
            slot = late_pop(c->late, &c->n_late).slot;
        else
            break;
        if (count == cap) {
            void *p = realloc(ended, (size_t)(cap *= 2) * sizeof *ended);
            if (!p) { free(ended); PyErr_NoMemory(); return -1; }
            ended = p;
        }
        ended[count][0] = c->flow_seq[slot];
        ended[count][1] = slot;
        count++;
    }
    if (count > 1) qsort(ended, (size_t)count, sizeof *ended, by_seq);
    PyObject **callbacks = malloc((size_t)(count ? count : 1) * sizeof(PyObject *));
    if (!callbacks) { free(ended); PyErr_NoMemory(); return -1; }
    for (int64_t k = 0; k < count; k++) {
        int64_t slot = ended[k][1];
        double freed = c->rate[slot];
        c->spare[c->first[slot]] += freed;
        if (c->second[slot]) c->spare[c->second[slot]] += freed;
        callbacks[k] = c->done[slot];  /* the slot's reference, now ours */
        remove_flow(c, slot);
    }
    free(ended);
    lagged_change(c);
    next_end(c);
    int status = 0;
    for (int64_t k = 0; k < count; k++) {
        if (!status) {
            PyObject *r = PyObject_CallNoArgs(callbacks[k]);
            if (!r) status = -1;
            Py_XDECREF(r);
        }
        Py_DECREF(callbacks[k]);
    }
    free(callbacks);
    return status;
}

/* Resizes *array to count items, leaving it as it was if memory runs out. */
static int resize(void **array, int64_t count, size_t item) {
    void *p = realloc(*array, (size_t)count * item);
    if (!p) return -1;
    *array = p;
    return 0;
}

static int add_slots(Core *c) {
    int64_t n = c->n_slots, more = n > 64 ? n : 64, total = n + more;
    size_t d = sizeof(double), i = sizeof(int64_t);
    /* n_slots grows only once all of them have the room. */
    if (resize((void **)&c->remaining, total, d) || resize((void **)&c->rate, total, d) ||
        resize((void **)&c->weight, total, d) || resize((void **)&c->first, total, i) ||
        resize((void **)&c->second, total, i) || resize((void **)&c->flow_seq, total, i) ||
        resize((void **)&c->done, total, sizeof(PyObject *)) ||
        resize((void **)&c->free_slots, total, i)) {
        PyErr_NoMemory();
        return -1;
    }
    for (int64_t s = n; s < total; s++) {  /* as the Python path's new slots */
        c->remaining[s] = INFINITY;
        c->rate[s] = 1.0;
        c->weight[s] = 0.0;
        c->first[s] = c->second[s] = c->flow_seq[s] = 0;
        c->done[s] = NULL;
    }
    for (int64_t k = 0; k < more; k++) c->free_slots[k] = total - 1 - k;  /* lowest on top */
    c->n_free = more;
    c->n_slots = total;
    return 0;
}

/* -- Python methods -------------------------------------------------------------------- */

static int core_init(PyObject *self, PyObject *args, PyObject *kwargs) {
    Core *c = (Core *)self;
    static char *names[] = {"rate_lag_s", NULL};
    double lag;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "d", names, &lag)) return -1;
    if (c->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Core.__init__ runs once");
        return -1;
    }
    if (!(lag > 0 && lag < INFINITY)) {
        PyObject *value = PyFloat_FromDouble(lag);
        if (value)
            PyErr_Format(PyExc_ValueError, "the compiled network takes a rate lag above 0 "
                         "and finite. Received: rate_lag_s=%R", value);
        Py_XDECREF(value);
        return -1;
    }
    c->rate_lag = lag;
    c->end_at = c->end_time = INFINITY;
    if (grow((void **)&c->capacity, &c->cap_capacity, 1, sizeof(double)) ||
        grow((void **)&c->spare, &c->cap_spare, 1, sizeof(double)))
        return -1;
    c->capacity[0] = c->spare[0] = INFINITY;
    c->n_links = 1;
    c->ready = 1;
    return 0;
}

static int check_ready(Core *c) {
    if (c->ready) return 0;
    PyErr_SetString(PyExc_RuntimeError, "Core.__init__ was not called");
    return -1;
}

static PyObject *core_at(PyObject *self, PyObject *args) {
    Core *c = (Core *)self;
    double t;
    PyObject *fn;
    if (check_ready(c) || !PyArg_ParseTuple(args, "dO:at", &t, &fn)) return NULL;
    if (!PyCallable_Check(fn)) {
        PyErr_Format(PyExc_TypeError, "at takes a callable. Received: %R", fn);
        return NULL;
    }
    if (queue_at(c, t, fn)) return NULL;
    Py_RETURN_NONE;
}

static PyObject *core_at_sorted(PyObject *self, PyObject *timed) {
    Core *c = (Core *)self;
    if (check_ready(c)) return NULL;
    if (!PyList_Check(timed)) {
        PyErr_Format(PyExc_TypeError, "at_sorted takes a list of (time, callable) pairs. "
                     "Received: %R", timed);
        return NULL;
    }
    Py_ssize_t n = PyList_Size(timed);
    double prior = -INFINITY;
    for (Py_ssize_t i = 0; i < n; i++) {  /* checked whole first: nothing queued if bad */
        PyObject *pair = PyList_GetItem(timed, i);
        double t;
        PyObject *fn;
        if (!PyTuple_Check(pair) || PyTuple_Size(pair) != 2 ||
            (t = PyFloat_AsDouble(PyTuple_GetItem(pair, 0)), PyErr_Occurred()) ||
            !PyCallable_Check(fn = PyTuple_GetItem(pair, 1)) || t < prior) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "at_sorted takes (time, callable) pairs in order "
                         "of time. Received at %zd: %R", i, pair);
            return NULL;
        }
        prior = t;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GetItem(timed, i);
        if (queue_at(c, PyFloat_AsDouble(PyTuple_GetItem(pair, 0)), PyTuple_GetItem(pair, 1)))
            return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *core_add_link(PyObject *self, PyObject *arg) {
    Core *c = (Core *)self;
    if (check_ready(c)) return NULL;
    double capacity = PyFloat_AsDouble(arg);
    if (PyErr_Occurred()) return NULL;
    if (!(capacity > 0)) {
        PyErr_Format(PyExc_ValueError, "a link's capacity must be above 0. Received: %R", arg);
        return NULL;
    }
    if (grow((void **)&c->capacity, &c->cap_capacity, c->n_links + 1, sizeof(double)) ||
        grow((void **)&c->spare, &c->cap_spare, c->n_links + 1, sizeof(double)))
        return NULL;
    c->capacity[c->n_links] = c->spare[c->n_links] = capacity;
    return PyLong_FromLongLong(c->n_links++);
}

/* _start(nbytes, first, second, weight, done): a flow over links first and
 * second (0: none) that takes what they have spare until the next rates. */
static PyObject *core_start(PyObject *self, PyObject *args) {
    Core *c = (Core *)self;
    double nbytes, weight;
    long long a, b;
    PyObject *done;
    if (check_ready(c) || !PyArg_ParseTuple(args, "dLLdO:_start", &nbytes, &a, &b, &weight, &done))
        return NULL;
    if (a < 1 || a >= c->n_links || b < 0 || b >= c->n_links || !(nbytes > 0) ||
        !(weight > 0) || !PyCallable_Check(done)) {
        PyErr_Format(PyExc_ValueError, "_start takes bytes > 0, link ids in [1, %lld) (the "
                     "second may be 0), a weight > 0 and a callable. Received: %R",
                     (long long)c->n_links, args);
        return NULL;
    }
    /* Room first: a failure leaves nothing half started. */
    if ((!c->n_free && add_slots(c)) ||
        grow((void **)&c->late, &c->cap_late, c->n_late + 1, sizeof(Late)))
        return NULL;
    int64_t slot = c->free_slots[--c->n_free];
    if (slot >= c->slots_used) c->slots_used = slot + 1;
    c->flow_seq[slot] = ++c->flows_started;
    Py_INCREF(done);
    c->done[slot] = done;
    c->weight[slot] = weight;
    c->first[slot] = a;
    c->second[slot] = b;
    double *spare = c->spare, rate = spare[a];  /* the least spare of its links */
    if (b && spare[b] < rate) rate = spare[b];
    if (0.0 > rate) rate = 0.0;
    c->rate[slot] = rate;
    double left = nbytes;
    if (rate > 0) {
        spare[a] -= rate;
        if (b) spare[b] -= rate;
        left += rate * (c->now - c->last);  /* as of last, as the other flows' */
        c->late[c->n_late] = (Late){c->now + nbytes / rate, c->flow_seq[slot], slot};
        late_up(c->late, c->n_late++);
        next_end(c);
    }
    c->remaining[slot] = left;
    lagged_change(c);
    Py_RETURN_NONE;
}

static PyObject *call_next(Core *c) {  /* the next event of the instant queue, taken */
    Event e = c->instant[c->instant_head];
    c->instant_head = (c->instant_head + 1) % c->cap_instant;
    c->n_instant--;
    return e.fn;
}

static int run_fn(PyObject *fn) {  /* runs a taken event and drops it */
    PyObject *r = PyObject_CallNoArgs(fn);
    Py_DECREF(fn);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *run_events(Core *c, PyObject *until, PyObject *items, Py_ssize_t count);

/* run(until): the events in order, the pending flow end among them at its
 * time and place, and the rates when due (simulate_rate_lag._lagged_run). */
static PyObject *core_run(PyObject *self, PyObject *args, PyObject *kwargs) {
    Core *c = (Core *)self;
    static char *names[] = {"until", NULL};
    PyObject *until;
    if (check_ready(c) || !PyArg_ParseTupleAndKeywords(args, kwargs, "O:run", names, &until))
        return NULL;
    /* until: a callable, or (list, count) to stop once the list holds count
     * items, checked without a call into Python at every event. */
    PyObject *items = NULL;
    Py_ssize_t count = 0;
    if (PyTuple_Check(until) && PyTuple_Size(until) == 2 &&
        PyList_Check(PyTuple_GetItem(until, 0))) {
        items = PyTuple_GetItem(until, 0);
        count = PyLong_AsSsize_t(PyTuple_GetItem(until, 1));
        if (count == -1 && PyErr_Occurred()) return NULL;
    } else if (!PyCallable_Check(until)) {
        PyErr_Format(PyExc_TypeError, "run takes a callable or a (list, count) pair as until. "
                     "Received: %R", until);
        return NULL;
    }
    Py_INCREF(until);  /* the list stays ours while callbacks run */
    PyObject *result = run_events(c, until, items, count);
    Py_DECREF(until);
    return result;
}

static PyObject *run_events(Core *c, PyObject *until, PyObject *items, Py_ssize_t count) {
    for (;;) {
        if (items) {
            if (PyList_Size(items) >= count) break;
        } else {
            PyObject *r = PyObject_CallNoArgs(until);
            if (!r) return NULL;
            int stop = PyObject_IsTrue(r);
            Py_DECREF(r);
            if (stop < 0) return NULL;
            if (stop) break;
        }
        if (c->n_instant) {  /* events at now: the rates are not due before they ran */
            int64_t place = c->instant[c->instant_head].seq;
            int status;
            if (c->n_events && c->events[0].t <= c->now && c->events[0].seq < place)
                status = run_fn(event_pop(c->events, &c->n_events).fn);
            else if (c->end_time <= c->now && c->end_place < place)
                status = end_now(c);
            else
                status = run_fn(call_next(c));
            if (status) return NULL;
            continue;
        }
        double t = c->n_events ? c->events[0].t : INFINITY, end = c->end_time;
        if (c->refill_due && (t < end ? t : end) > c->refill_at) {
            /* After the last event of that instant: its changes are all in. */
            if (c->refill_at > c->now) c->now = c->refill_at;
            if (refill(c)) return NULL;
            continue;
        }
        if (end < t || (end == t && t < INFINITY && c->end_place < c->events[0].seq)) {
            c->now = end;
            if (end_now(c)) return NULL;
        } else if (c->n_events) {
            Event e = event_pop(c->events, &c->n_events);
            c->now = e.t;
            if (run_fn(e.fn)) return NULL;
        } else {
            break;
        }
    }
    Py_RETURN_NONE;
}

static PyObject *core_refill(PyObject *self, PyObject *Py_UNUSED(unused)) {
    Core *c = (Core *)self;
    if (check_ready(c) || refill(c)) return NULL;
    Py_RETURN_NONE;
}

/* _flows(): (start order, first link, second link, rate) of each flow in flight. */
static PyObject *core_flows(PyObject *self, PyObject *Py_UNUSED(unused)) {
    Core *c = (Core *)self;
    if (check_ready(c)) return NULL;
    PyObject *list = PyList_New(0);
    for (int64_t s = 0; list && s < c->n_slots; s++) {
        if (!c->done[s]) continue;
        PyObject *item = Py_BuildValue("(LLLd)", (long long)c->flow_seq[s],
                                       (long long)c->first[s], (long long)c->second[s],
                                       c->rate[s]);
        if (!item || PyList_Append(list, item)) Py_CLEAR(list);
        Py_XDECREF(item);
    }
    return list;
}

static PyObject *core_get_now(PyObject *self, void *Py_UNUSED(unused)) {
    return PyFloat_FromDouble(((Core *)self)->now);
}

static int core_traverse(PyObject *self, visitproc visit, void *arg) {
    Core *c = (Core *)self;
    Py_VISIT(Py_TYPE(self));
    for (int64_t i = 0; i < c->n_events; i++) Py_VISIT(c->events[i].fn);
    for (int64_t i = 0; i < c->n_instant; i++)
        Py_VISIT(c->instant[(c->instant_head + i) % c->cap_instant].fn);
    for (int64_t s = 0; s < c->n_slots; s++) Py_VISIT(c->done[s]);
    return 0;
}

static int core_clear(PyObject *self) {
    Core *c = (Core *)self;
    while (c->n_events) { c->n_events--; Py_CLEAR(c->events[c->n_events].fn); }
    while (c->n_instant) {
        c->n_instant--;
        Py_CLEAR(c->instant[(c->instant_head + c->n_instant) % c->cap_instant].fn);
    }
    for (int64_t s = 0; s < c->n_slots; s++) Py_CLEAR(c->done[s]);
    return 0;
}

static void core_dealloc(PyObject *self) {
    Core *c = (Core *)self;
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    core_clear(self);
    free(c->events); free(c->instant); free(c->capacity); free(c->spare);
    free(c->remaining); free(c->rate); free(c->weight); free(c->first); free(c->second);
    free(c->flow_seq); free(c->done); free(c->free_slots); free(c->late);
    free(c->end_times); free(c->end_slots);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(self);
    Py_DECREF(type);
}

static PyMethodDef core_methods[] = {
    {"at", core_at, METH_VARARGS, "at(t, fn): runs fn at time t (now if t has passed)."},
    {"at_sorted", core_at_sorted, METH_O,
     "at_sorted([(t, fn), ...]): queues pairs given in order of time, as at one by one."},
    {"_add_link", core_add_link, METH_O, "_add_link(capacity) -> the new link's id."},
    {"_start", core_start, METH_VARARGS,
     "_start(nbytes, first, second, weight, done): a flow over link ids (second 0: none)."},
    {"run", (PyCFunction)(void (*)(void))core_run, METH_VARARGS | METH_KEYWORDS, "run(until): runs events until until() is true or none are left."},
    {"_refill", core_refill, METH_NOARGS, "Computes the rates of the flows in flight now."},
    {"_flows", core_flows, METH_NOARGS,
     "[(start order, first link, second link, rate)] of the flows in flight."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef core_getset[] = {
    {"now", core_get_now, NULL, "Virtual time (s).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot core_slots[] = {
    {Py_tp_doc, "The simulator's event queue and links with a rate lag (see the source)."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, core_init},
    {Py_tp_dealloc, core_dealloc},
    {Py_tp_traverse, core_traverse},
    {Py_tp_clear, core_clear},
    {Py_tp_methods, core_methods},
    {Py_tp_getset, core_getset},
    {0, NULL},
};

static PyType_Spec core_spec = {
    "prophet_tf._fluid_core.Core", sizeof(Core), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, core_slots,
};

static int module_exec(PyObject *module) {
    PyObject *type = PyType_FromSpec(&core_spec);
    if (!type) return -1;
    int status = PyModule_AddObjectRef(module, "Core", type);
    Py_DECREF(type);
    return status;
}

static PyModuleDef_Slot module_slots[] = {{Py_mod_exec, module_exec}, {0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_fluid_core",
    "The simulator's compiled event queue and network (native/fluid_core.c).", 0, NULL,
    module_slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fluid_core(void) { return PyModuleDef_Init(&module_def); }
