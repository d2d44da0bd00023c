/* deep_ep_npu.kernels._cpu: the checked Python bindings of the loops in loops.c (their Python side:
 * kernels/__init__.py). Each binding takes the tensors themselves and plain ints, declares them once in an argument
 * spec, and checks before any loop runs: the argument count, that each tensor argument is a contiguous CPU tensor
 * (duck-typed: is_cpu, is_contiguous(), data_ptr(), nbytes), that each holds every byte the loop will touch, and
 * that each index the loop follows lands inside its tensor. A wrong call raises TypeError / ValueError /
 * IndexError; it never reaches memory it should not. The loops run with the GIL released. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdarg.h>
#include <string.h>

#include "loops.h"

#ifndef DEP_SOURCES_SHA
#define DEP_SOURCES_SHA "" /* set by setup.py: the hash of the C sources built */
#endif

static PyObject *s_is_cpu, *s_is_contiguous, *s_data_ptr, *s_nbytes, *s_shape, *s_stride, *s_element_size;

typedef struct {
    uint8_t *ptr; /* NULL for None (and maybe for an empty tensor) */
    int64_t nbytes;
    int none; /* None was given */
} Buf;

typedef struct { /* a 2-D CPU tensor whose rows may be strided (columns contiguous) */
    const uint8_t *ptr;
    int64_t rows, row_bytes, stride; /* bytes */
} Rows;

static int64_t attr_int(PyObject *o, PyObject *name, int call) {
    PyObject *v = call ? PyObject_CallMethodNoArgs(o, name) : PyObject_GetAttr(o, name);
    if (!v)
        return -1;
    int64_t n = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return n;
}

/* Whether o is a CPU tensor (with contiguous, a contiguous one): else TypeError / ValueError naming fn and arg. */
static int cpu_tensor(PyObject *o, const char *fn, const char *arg, int contiguous) {
    PyObject *cpu = PyObject_GetAttr(o, s_is_cpu);
    if (!cpu) {
        PyErr_Format(PyExc_TypeError, "%s(): %s must be a tensor, not %.80s", fn, arg, Py_TYPE(o)->tp_name);
        return 0;
    }
    int ok = PyObject_IsTrue(cpu);
    Py_DECREF(cpu);
    if (ok != 1) {
        if (ok == 0)
            PyErr_Format(PyExc_ValueError, "%s(): %s must be a CPU tensor", fn, arg);
        return 0;
    }
    if (!contiguous)
        return 1;
    PyObject *c = PyObject_CallMethodNoArgs(o, s_is_contiguous);
    ok = c ? PyObject_IsTrue(c) : -1;
    Py_XDECREF(c);
    if (ok == 0)
        PyErr_Format(PyExc_ValueError, "%s(): %s must be contiguous", fn, arg);
    return ok == 1;
}

static int to_buf(PyObject *o, Buf *b, const char *fn, const char *arg) {
    if (!cpu_tensor(o, fn, arg, 1))
        return 0;
    int64_t ptr = attr_int(o, s_data_ptr, 1), nbytes = ptr == -1 && PyErr_Occurred() ? -1 : attr_int(o, s_nbytes, 0);
    b->ptr = (uint8_t *)(uintptr_t)ptr, b->nbytes = nbytes, b->none = 0;
    return !PyErr_Occurred();
}

static int to_rows(PyObject *o, Rows *r, const char *fn, const char *arg) {
    if (!cpu_tensor(o, fn, arg, 0))
        return 0;
    PyObject *shape = PyObject_GetAttr(o, s_shape), *stride = PyObject_CallMethodNoArgs(o, s_stride);
    int64_t item = attr_int(o, s_element_size, 1), ptr = attr_int(o, s_data_ptr, 1);
    int ok = shape && stride && !PyErr_Occurred() && PyTuple_Check(shape) && PyTuple_Check(stride);
    if (ok && (PyTuple_GET_SIZE(shape) != 2 || PyTuple_GET_SIZE(stride) != 2)) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must be 2-D", fn, arg);
        ok = 0;
    }
    if (ok) {
        int64_t cols = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, 1));
        int64_t step = PyLong_AsLongLong(PyTuple_GET_ITEM(stride, 1));
        r->rows = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, 0));
        r->stride = PyLong_AsLongLong(PyTuple_GET_ITEM(stride, 0)) * item;
        r->row_bytes = cols * item, r->ptr = (const uint8_t *)(uintptr_t)ptr;
        ok = !PyErr_Occurred();
        if (ok && step != 1 && cols > 1) {
            PyErr_Format(PyExc_ValueError, "%s(): %s's rows must be contiguous", fn, arg);
            ok = 0;
        }
    }
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    return ok;
}

/* Parse args against spec, one "KIND:name" per argument, space-separated: T a contiguous CPU tensor (Buf *), t the
 * same or None (Buf *, ptr NULL), R a 2-D CPU tensor with contiguous rows (Rows *), i an int (int64_t *), O any
 * object (PyObject **, borrowed). */
static int parse(const char *fn, PyObject *const *args, Py_ssize_t nargs, const char *spec, ...) {
    Py_ssize_t want = 1;
    for (const char *c = spec; *c; c++)
        want += *c == ' ';
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", fn, want, nargs);
        return 0;
    }
    va_list ap;
    va_start(ap, spec);
    const char *c = spec;
    int ok = 1;
    for (Py_ssize_t i = 0; i < nargs && ok; i++) {
        char kind = c[0], name[32];
        const char *end = strchr(c, ' ');
        size_t len = (size_t)((end ? end : c + strlen(c)) - (c + 2));
        memcpy(name, c + 2, len < sizeof name ? len : sizeof name - 1);
        name[len < sizeof name ? len : sizeof name - 1] = 0;
        c = end ? end + 1 : c;
        PyObject *o = args[i];
        if (kind == 'i') {
            int64_t *v = va_arg(ap, int64_t *);
            *v = PyLong_AsLongLong(o);
            if (*v == -1 && PyErr_Occurred()) { /* (an int out of range keeps its OverflowError) */
                if (PyErr_ExceptionMatches(PyExc_TypeError))
                    PyErr_Format(PyExc_TypeError, "%s(): %s must be an int, not %.80s", fn, name, Py_TYPE(o)->tp_name);
                ok = 0;
            }
        } else if (kind == 'R') {
            ok = to_rows(o, va_arg(ap, Rows *), fn, name);
        } else if (kind == 'O') {
            *va_arg(ap, PyObject **) = o;
        } else {
            Buf *b = va_arg(ap, Buf *);
            if (kind == 't' && o == Py_None)
                b->ptr = NULL, b->nbytes = 0, b->none = 1;
            else
                ok = to_buf(o, b, fn, name);
        }
    }
    va_end(ap);
    return ok;
}

/* a * b * c, or -1 when a factor is negative or the product overflows. */
static int64_t size3(int64_t a, int64_t b, int64_t c) {
    int64_t ab, abc;
    if (a < 0 || b < 0 || c < 0 || __builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, &abc))
        return -1;
    return abc;
}

/* Whether b holds need bytes (need from size3; -1: the sizes are out of range). */
static int holds(const char *fn, const char *arg, const Buf *b, int64_t need) {
    if (need < 0)
        PyErr_Format(PyExc_ValueError, "%s(): the sizes given for %s are negative or overflow", fn, arg);
    else if (b->nbytes < need)
        PyErr_Format(PyExc_ValueError, "%s(): %s holds %lld bytes, the kernel touches %lld", fn, arg,
                     (long long)b->nbytes, (long long)need);
    return need >= 0 && b->nbytes >= need;
}

/* Whether a field of `width` bytes at `off` lies inside a row of row_bytes. */
static int field(const char *fn, const char *what, int64_t off, int64_t width, int64_t row_bytes) {
    if (off >= 0 && width >= 0 && off <= row_bytes - width)
        return 1;
    PyErr_Format(PyExc_ValueError, "%s(): the %s (%lld bytes at %lld) is outside a row of %lld bytes", fn, what,
                 (long long)width, (long long)off, (long long)row_bytes);
    return 0;
}

/* Whether each of the n int64 values at v is in [0, bound). */
static int inside(const int64_t *v, int64_t n, int64_t bound) {
    for (int64_t i = 0; i < n; i++)
        if (v[i] < 0 || v[i] >= bound)
            return 0;
    return 1;
}

static int dtype_size(const char *fn, int64_t dtype) {
    if (dtype >= 0 && dtype <= 2 && dep_has_dtype((int)dtype))
        return dtype == DTYPE_F32 ? 4 : 2;
    PyErr_Format(PyExc_ValueError, "%s(): dtype code %lld is not in this build", fn, (long long)dtype);
    return 0;
}

#define METHOD(name) static PyObject *py_##name(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
#define NOGIL(stmt) Py_BEGIN_ALLOW_THREADS stmt; Py_END_ALLOW_THREADS

/* The fp32 sums' shared checks: acc [num_tokens][hidden] fp32, token [n] int64 and weight [n] fp32. */
static int sum_args(const char *fn, const Buf *acc, int64_t num_tokens, int64_t hidden, const Buf *token,
                    const Buf *weight, int64_t n) {
    return holds(fn, "acc", acc, size3(num_tokens, hidden, 4)) && holds(fn, "token", token, size3(n, 8, 1)) &&
           holds(fn, "weight", weight, size3(n, 4, 1));
}

static PyObject *summed(int rc, const char *fn, int64_t num_tokens) {
    if (rc == -3)
        return PyErr_NoMemory();
    if (rc)
        return PyErr_Format(PyExc_IndexError, "%s: a token index is outside [0, %lld)", fn, (long long)num_tokens);
    Py_RETURN_NONE;
}

METHOD(accumulate) {
    const char *fn = "accumulate";
    Buf acc, index, token, weight;
    Rows x;
    int64_t num_tokens, hidden, dtype, n, zero_first;
    if (!parse(fn, args, nargs, "T:acc i:num_tokens i:hidden R:x i:dtype t:index T:token T:weight i:n i:zero_first",
               &acc, &num_tokens, &hidden, &x, &dtype, &index, &token, &weight, &n, &zero_first))
        return NULL;
    int item = dtype_size(fn, dtype);
    if (!item || !sum_args(fn, &acc, num_tokens, hidden, &token, &weight, n))
        return NULL;
    if (hidden * item > x.row_bytes)
        return PyErr_Format(PyExc_ValueError, "%s(): x's rows are narrower than hidden", fn);
    if (!index.none && !holds(fn, "index", &index, size3(n, 8, 1)))
        return NULL;
    if (index.none ? n > x.rows : !inside((const int64_t *)index.ptr, n, x.rows))
        return PyErr_Format(PyExc_IndexError, "accumulate: row index past the %lld rows of x", (long long)x.rows);
    int rc;
    NOGIL(rc = dep_accumulate((float *)acc.ptr, num_tokens, hidden, x.ptr, x.stride, (int)dtype,
                                       (const int64_t *)index.ptr, NULL, (const int64_t *)token.ptr,
                                       (const float *)weight.ptr, n, (int)zero_first));
    return summed(rc, fn, num_tokens);
}

/* accumulate_rows' row addresses: pair i's row is y[order[i]], y the rows of `rows` ((x, index or None) pairs) one
 * after another. Returns a new int64 array of n addresses, or NULL with an exception set. */
static int64_t *row_addresses(const char *fn, PyObject *rows, int64_t hidden_bytes, const Buf *order, int64_t n) {
    PyObject *seq = PySequence_Fast(rows, "accumulate_rows(): rows must be a list of (x, index) pairs");
    if (!seq)
        return NULL;
    Py_ssize_t parts = PySequence_Fast_GET_SIZE(seq);
    int64_t total = 0, *y = NULL, *at = NULL;
    Rows *xs = PyMem_Calloc((size_t)parts + 1, sizeof(Rows));
    Buf *ix = PyMem_Calloc((size_t)parts + 1, sizeof(Buf)); /* (none: all of x's rows) */
    int ok = xs && ix;
    if (!ok)
        PyErr_NoMemory();
    for (Py_ssize_t p = 0; ok && p < parts; p++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(seq, p);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_Format(PyExc_TypeError, "%s(): rows must be a list of (x, index) pairs", fn);
            ok = 0;
            break;
        }
        PyObject *index = PyTuple_GET_ITEM(pair, 1);
        ix[p].none = index == Py_None;
        ok = to_rows(PyTuple_GET_ITEM(pair, 0), &xs[p], fn, "a row tensor") &&
             (ix[p].none || to_buf(index, &ix[p], fn, "a row index"));
        if (ok && xs[p].row_bytes < hidden_bytes) {
            PyErr_Format(PyExc_ValueError, "%s(): a row tensor's rows are narrower than hidden", fn);
            ok = 0;
        }
        int64_t k = ix[p].none ? xs[p].rows : ix[p].nbytes / 8;
        if (ok && !ix[p].none && !inside((const int64_t *)ix[p].ptr, k, xs[p].rows)) {
            PyErr_Format(PyExc_IndexError, "accumulate_rows: a row index is outside [0, %lld)", (long long)xs[p].rows);
            ok = 0;
        }
        total += k;
    }
    if (ok && !inside((const int64_t *)order->ptr, n, total)) {
        PyErr_Format(PyExc_IndexError, "accumulate_rows: an order index is outside [0, %lld)", (long long)total);
        ok = 0;
    }
    if (ok && (!(y = PyMem_Malloc(sizeof(int64_t) * (size_t)(total + 1))) ||
               !(at = PyMem_Malloc(sizeof(int64_t) * (size_t)(n + 1))))) {
        PyErr_NoMemory();
        ok = 0;
    }
    for (Py_ssize_t p = 0, k = 0; ok && p < parts; p++) {
        const int64_t *index = ix[p].none ? NULL : (const int64_t *)ix[p].ptr;
        for (int64_t j = 0, m = ix[p].none ? xs[p].rows : ix[p].nbytes / 8; j < m; j++)
            y[k++] = (int64_t)(uintptr_t)(xs[p].ptr + (index ? index[j] : j) * xs[p].stride);
    }
    for (int64_t i = 0; ok && i < n; i++)
        at[i] = y[((const int64_t *)order->ptr)[i]];
    PyMem_Free(y);
    PyMem_Free(xs);
    PyMem_Free(ix);
    Py_DECREF(seq);
    if (!ok) {
        PyMem_Free(at);
        return NULL;
    }
    return at;
}

METHOD(accumulate_rows) {
    const char *fn = "accumulate_rows";
    Buf acc, order, token, weight;
    PyObject *rows;
    int64_t num_tokens, hidden, dtype, n;
    if (!parse(fn, args, nargs, "T:acc i:num_tokens i:hidden i:dtype O:rows T:order T:token T:weight i:n", &acc,
               &num_tokens, &hidden, &dtype, &rows, &order, &token, &weight, &n))
        return NULL;
    int item = dtype_size(fn, dtype);
    if (!item || !sum_args(fn, &acc, num_tokens, hidden, &token, &weight, n) ||
        !holds(fn, "order", &order, size3(n, 8, 1)))
        return NULL;
    int64_t *at = row_addresses(fn, rows, hidden * item, &order, n);
    if (!at)
        return NULL;
    int rc;
    NOGIL(rc = dep_accumulate((float *)acc.ptr, num_tokens, hidden, NULL, 0, (int)dtype, NULL, at,
                                       (const int64_t *)token.ptr, (const float *)weight.ptr, n, 1));
    PyMem_Free(at);
    return summed(rc, "accumulate", num_tokens);
}

METHOD(sum_tokens) {
    const char *fn = "sum_tokens";
    Buf out, order, token, weight;
    PyObject *rows;
    int64_t num_tokens, hidden, out_dtype, dtype, n;
    if (!parse(fn, args, nargs, "T:out i:num_tokens i:hidden i:out_dtype i:dtype O:rows T:order T:token T:weight i:n",
               &out, &num_tokens, &hidden, &out_dtype, &dtype, &rows, &order, &token, &weight, &n))
        return NULL;
    int item = dtype_size(fn, dtype), out_item = dtype_size(fn, out_dtype);
    if (!item || !out_item || !holds(fn, "out", &out, size3(num_tokens, hidden, out_item)) ||
        !holds(fn, "token", &token, size3(n, 8, 1)) || !holds(fn, "weight", &weight, size3(n, 4, 1)) ||
        !holds(fn, "order", &order, size3(n, 8, 1)))
        return NULL;
    int64_t *at = row_addresses(fn, rows, hidden * item, &order, n);
    if (!at)
        return NULL;
    int rc;
    NOGIL(rc = dep_sum_tokens(out.ptr, (int)out_dtype, num_tokens, hidden, (int)dtype, at,
                              (const int64_t *)token.ptr, (const float *)weight.ptr, n));
    PyMem_Free(at);
    if (rc == -2)
        return PyErr_Format(PyExc_ValueError, "%s(): out must be fp32 or bf16", fn);
    if (rc == -1)
        return PyErr_Format(PyExc_IndexError, "%s: a token is outside [0, %lld) or out of order", fn,
                            (long long)num_tokens);
    return summed(rc, fn, num_tokens);
}

/* pos [num_local] int64 (rows placed so far per expert) must be in [0, cap]: the loops write from there on. */
static int positions(const char *fn, const Buf *pos, int64_t num_local, int64_t cap) {
    if (!holds(fn, "pos", pos, size3(num_local, 8, 1)))
        return 0;
    if (inside((const int64_t *)pos->ptr, num_local, cap + 1))
        return 1;
    PyErr_Format(PyExc_ValueError, "%s(): pos holds a row outside [0, %lld]", fn, (long long)cap);
    return 0;
}

/* The masked layout's outputs: recv [L][cap][data_bytes], src_info [L][cap] int32, pos [L], counts [L][R] int64. */
static int masked_out(const char *fn, const Buf *recv, const Buf *src_info, const Buf *pos, const Buf *counts,
                      int64_t data_bytes, int64_t num_local, int64_t cap, int64_t num_ranks, int64_t src) {
    if (src < 0 || src >= num_ranks) {
        PyErr_Format(PyExc_ValueError, "%s(): source %lld is outside [0, %lld)", fn, (long long)src,
                     (long long)num_ranks);
        return 0;
    }
    return holds(fn, "recv", recv, size3(num_local, cap, data_bytes)) &&
           holds(fn, "src_info", src_info, size3(num_local, cap, 4)) && positions(fn, pos, num_local, cap) &&
           holds(fn, "counts", counts, size3(num_local, num_ranks, 8));
}

METHOD(place) {
    const char *fn = "place";
    Buf rows, recv, src_info, pos, counts, pairs;
    int64_t n, row_bytes, data_bytes, token_off, slot_off, num_slots, num_local, cap, num_ranks, src;
    if (!parse(fn, args, nargs,
               "T:rows i:n i:row_bytes i:data_bytes i:token_off i:slot_off i:num_slots i:num_local i:cap "
               "i:num_ranks i:src T:recv T:src_info T:pos T:counts T:pairs",
               &rows, &n, &row_bytes, &data_bytes, &token_off, &slot_off, &num_slots, &num_local, &cap, &num_ranks,
               &src, &recv, &src_info, &pos, &counts, &pairs))
        return NULL;
    int64_t room = pairs.nbytes / 16; /* pairs [2][room] int64: (row, flat position) of each pair */
    if (!holds(fn, "rows", &rows, size3(n, row_bytes, 1)) || !field(fn, "data", 0, data_bytes, row_bytes) ||
        !field(fn, "token", token_off, 4, row_bytes) ||
        !field(fn, "slots", slot_off, size3(num_slots, 4, 1), row_bytes) ||
        !masked_out(fn, &recv, &src_info, &pos, &counts, data_bytes, num_local, cap, num_ranks, src))
        return NULL;
    if (size3(n, num_slots, 1) > room)
        return PyErr_Format(PyExc_ValueError, "%s(): pairs has room for %lld pairs, not n * num_slots", fn,
                           (long long)room);
    int64_t k;
    NOGIL(k = dep_place(rows.ptr, n, row_bytes, data_bytes, token_off, slot_off, num_slots, num_local, cap,
                                 num_ranks, src, recv.ptr, (int32_t *)src_info.ptr, (int64_t *)pos.ptr,
                                 (int64_t *)counts.ptr, (int64_t *)pairs.ptr, (int64_t *)pairs.ptr + room));
    if (k < 0)
        return PyErr_Format(PyExc_ValueError, k == -1 ? "dispatch rows name a local expert outside the layout"
                                                      : "dispatch rows exceed an expert's R * N rows");
    return PyLong_FromLongLong(k);
}

METHOD(check_ids) {
    Buf ids;
    int64_t n, k, lo, hi;
    if (!parse("check_ids", args, nargs, "T:ids i:n i:k i:lo i:hi", &ids, &n, &k, &lo, &hi) ||
        !holds("check_ids", "ids", &ids, size3(n, k, 8)))
        return NULL;
    int bad;
    NOGIL(bad = dep_check_ids((const int64_t *)ids.ptr, n, k, lo, hi));
    return PyBool_FromLong(!bad);
}

METHOD(plan) {
    const char *fn = "plan";
    Buf ids, mask, buf, slot_expert;
    int64_t t, k, nl, r, me, per_pair_rows;
    if (!parse(fn, args, nargs, "T:ids i:T i:K i:L i:R i:me T:mask i:per_pair_rows T:buf t:slot_expert", &ids, &t,
               &k, &nl, &r, &me, &mask, &per_pair_rows, &buf, &slot_expert))
        return NULL;
    int64_t p = size3(t, k, 1), scratch = size3(r, nl + t, 1);
    int64_t words = p < 0 || scratch < 0 ? -1 : 6 * p + 2 * r + scratch;
    if (nl < 1 || r < 1 || me < 0 || me >= r)
        return PyErr_Format(PyExc_ValueError, "%s(): needs L >= 1, R >= 1 and 0 <= me < R", fn);
    if (!holds(fn, "ids", &ids, size3(p, 8, 1)) || !holds(fn, "mask", &mask, r) ||
        !holds(fn, "buf", &buf, size3(words, 8, 1)) ||
        (!per_pair_rows && !slot_expert.none && !holds(fn, "slot_expert", &slot_expert, size3(p, k, 4))))
        return NULL;
    const int64_t *id = (const int64_t *)ids.ptr;
    for (int64_t i = 0; i < p; i++)
        if (id[i] >= r * nl)
            return PyErr_Format(PyExc_ValueError, "%s(): id %lld is not below R * L = %lld", fn, (long long)id[i],
                                (long long)(r * nl));
    int64_t *at = (int64_t *)buf.ptr, num_pairs, num_rows;
    NOGIL(num_pairs = dep_plan(id, t, k, nl, r, me, mask.ptr, (int)per_pair_rows, at, at + p, at + 2 * p,
                                        at + 3 * p, at + 6 * p, at + 4 * p, at + 5 * p, at + 6 * p + r,
                                        (int32_t *)slot_expert.ptr, at + 6 * p + 2 * r, &num_rows));
    return Py_BuildValue("LL", (long long)num_pairs, (long long)num_rows);
}

/* The packers' shared checks: x [x_rows][x_row_bytes], row_token [n] int64 inside x, slot_expert [n][k] int32, out
 * [n][row_bytes] with data_bytes of data first and the token / slot fields. */
static int pack_args(const char *fn, const Buf *x, int64_t x_rows, int64_t x_row_bytes, const Buf *row_token,
                     const Buf *slot_expert, int64_t n, int64_t k, const Buf *out, int64_t row_bytes,
                     int64_t data_bytes, int64_t token_off, int64_t slot_off) {
    if (!holds(fn, "x", x, size3(x_rows, x_row_bytes, 1)) || !holds(fn, "row_token", row_token, size3(n, 8, 1)) ||
        !holds(fn, "slot_expert", slot_expert, size3(n, k, 4)) || !holds(fn, "out", out, size3(n, row_bytes, 1)) ||
        !field(fn, "data", 0, data_bytes, row_bytes) || !field(fn, "token", token_off, 4, row_bytes) ||
        !field(fn, "slots", slot_off, size3(k, 4, 1), row_bytes))
        return 0;
    if (inside((const int64_t *)row_token->ptr, n, x_rows))
        return 1;
    PyErr_Format(PyExc_IndexError, "%s: a token is outside [0, %lld)", fn, (long long)x_rows);
    return 0;
}

METHOD(pack) {
    const char *fn = "pack";
    Buf x, row_token, slot_expert, out;
    int64_t x_rows, data_bytes, n, k, row_bytes, token_off, slot_off, streaming;
    if (!parse(fn, args, nargs,
               "T:x i:x_rows i:data_bytes T:row_token T:slot_expert i:n i:k T:out i:row_bytes i:token_off "
               "i:slot_off i:streaming",
               &x, &x_rows, &data_bytes, &row_token, &slot_expert, &n, &k, &out, &row_bytes, &token_off, &slot_off,
               &streaming) ||
        !pack_args(fn, &x, x_rows, data_bytes, &row_token, &slot_expert, n, k, &out, row_bytes, data_bytes,
                   token_off, slot_off))
        return NULL;
    NOGIL(dep_pack(x.ptr, data_bytes, (const int64_t *)row_token.ptr, (const int32_t *)slot_expert.ptr, n,
                            k, out.ptr, row_bytes, token_off, slot_off, (int)streaming));
    Py_RETURN_NONE;
}

/* The quantizing packers' return: True packed, False a row the torch code must write (NaN / Inf). */
static PyObject *packed(int rc) {
    if (rc == -3)
        return PyErr_NoMemory();
    return PyBool_FromLong(rc == 0);
}

METHOD(pack_int8) {
    const char *fn = "pack_int8";
    Buf x, row_token, slot_expert, weights, out;
    int64_t x_rows, dtype, hidden, n, k, row_bytes, scale_off, token_off, slot_off, weight_off;
    if (!parse(fn, args, nargs,
               "T:x i:x_rows i:dtype i:hidden T:row_token T:slot_expert i:n i:k T:out i:row_bytes i:scale_off "
               "i:token_off i:slot_off t:weights i:weight_off",
               &x, &x_rows, &dtype, &hidden, &row_token, &slot_expert, &n, &k, &out, &row_bytes, &scale_off,
               &token_off, &slot_off, &weights, &weight_off))
        return NULL;
    int item = dtype_size(fn, dtype);
    if (!item ||
        !pack_args(fn, &x, x_rows, size3(hidden, item, 1), &row_token, &slot_expert, n, k, &out, row_bytes, hidden,
                   token_off, slot_off) ||
        !field(fn, "scale", scale_off, 4, row_bytes))
        return NULL;
    if (!weights.none &&
        (!holds(fn, "weights", &weights, size3(n, k, 4)) ||
         !field(fn, "weights", weight_off, size3(k, 4, 1), row_bytes)))
        return NULL;
    int rc;
    NOGIL(rc = dep_pack_int8(x.ptr, (int)dtype, hidden, (const int64_t *)row_token.ptr,
                                      (const int32_t *)slot_expert.ptr, (const float *)weights.ptr, n, k, out.ptr,
                                      row_bytes, scale_off, token_off, slot_off, weight_off));
    return packed(rc);
}

METHOD(pack_fp8) {
    const char *fn = "pack_fp8";
    Buf x, row_token, slot_expert, out;
    int64_t x_rows, dtype, hidden, n, k, row_bytes, scale_off, token_off, slot_off;
    if (!parse(fn, args, nargs,
               "T:x i:x_rows i:dtype i:hidden T:row_token T:slot_expert i:n i:k T:out i:row_bytes i:scale_off "
               "i:token_off i:slot_off",
               &x, &x_rows, &dtype, &hidden, &row_token, &slot_expert, &n, &k, &out, &row_bytes, &scale_off,
               &token_off, &slot_off))
        return NULL;
    int item = dtype_size(fn, dtype);
    if (!item || hidden % 128)
        return item ? PyErr_Format(PyExc_ValueError, "%s(): hidden must be a multiple of 128", fn) : NULL;
    if (!pack_args(fn, &x, x_rows, size3(hidden, item, 1), &row_token, &slot_expert, n, k, &out, row_bytes, hidden,
                   token_off, slot_off) ||
        !field(fn, "scales", scale_off, size3(hidden / 128, 4, 1), row_bytes))
        return NULL;
    int rc;
    NOGIL(rc = dep_pack_fp8(x.ptr, (int)dtype, hidden, (const int64_t *)row_token.ptr,
                                     (const int32_t *)slot_expert.ptr, n, k, out.ptr, row_bytes, scale_off, token_off,
                                     slot_off));
    return packed(rc);
}

METHOD(to_e4m3) {
    Buf x, out;
    int64_t n;
    if (!parse("to_e4m3", args, nargs, "T:x i:n T:out", &x, &n, &out) ||
        !holds("to_e4m3", "x", &x, size3(n, 4, 1)) || !holds("to_e4m3", "out", &out, size3(n, 1, 1)))
        return NULL;
    NOGIL(dep_to_e4m3((const float *)x.ptr, n, out.ptr));
    Py_RETURN_NONE;
}

METHOD(gather) {
    const char *fn = "gather";
    Buf index;
    Rows x, out; /* (rows may be strided: the first columns of wider rows) */
    int64_t x_rows, row_bytes, n;
    if (!parse(fn, args, nargs, "R:x i:x_rows i:row_bytes T:index i:n R:out", &x, &x_rows, &row_bytes, &index, &n,
               &out) ||
        !holds(fn, "index", &index, size3(n, 8, 1)))
        return NULL;
    if (x_rows < 0 || x.rows < x_rows || x.row_bytes < row_bytes || (x_rows > 1 && x.stride < row_bytes))
        return PyErr_Format(PyExc_ValueError, "%s(): x holds fewer than %lld rows of %lld bytes", fn,
                            (long long)x_rows, (long long)row_bytes);
    if (n < 0 || out.rows < n || out.row_bytes < row_bytes || (n > 1 && out.stride < row_bytes))
        return PyErr_Format(PyExc_ValueError, "%s(): out holds fewer than %lld rows of %lld bytes", fn, (long long)n,
                            (long long)row_bytes);
    if (!inside((const int64_t *)index.ptr, n, x_rows))
        return PyErr_Format(PyExc_IndexError, "gather: a row index is outside [0, %lld)", (long long)x_rows);
    NOGIL(dep_gather(x.ptr, x.stride, row_bytes, (const int64_t *)index.ptr, n, (uint8_t *)out.ptr, out.stride));
    Py_RETURN_NONE;
}

METHOD(expert_mm) {
    const char *fn = "expert_mm";
    Buf x, w, y, offs;
    int64_t rows, E, N, K, threads, max_rows;
    if (!parse(fn, args, nargs, "T:x i:rows T:w i:E i:N i:K T:y T:offs i:threads i:max_rows", &x, &rows, &w, &E, &N,
               &K, &y, &offs, &threads, &max_rows) ||
        !holds(fn, "x", &x, size3(rows, K, 2)) || !holds(fn, "w", &w, size3(E, N, K * 2)) ||
        !holds(fn, "y", &y, size3(rows, N, 2)) || !holds(fn, "offs", &offs, size3(E, 4, 1)))
        return NULL;
    const int32_t *o = (const int32_t *)offs.ptr;
    for (int64_t e = 0; e < E; e++)
        if (o[e] < (e ? o[e - 1] : 0) || o[e] > rows)
            return PyErr_Format(PyExc_ValueError, "expert_mm(): offs[%lld] = %d is not in [offs[e - 1], %lld]",
                                (long long)e, o[e], (long long)rows);
    int done;
    NOGIL(done = dep_expert_mm((const uint16_t *)x.ptr, (const uint16_t *)w.ptr, (uint16_t *)y.ptr, o, E, N, K,
                               threads, max_rows));
    return PyBool_FromLong(done);
}

METHOD(rms_norm) {
    const char *fn = "rms_norm";
    Buf x, w, y;
    int64_t rows, H, w_fp32, round_first;
    PyObject *eps_obj;
    if (!parse(fn, args, nargs, "T:x i:rows i:H T:w i:w_fp32 i:round_first O:eps T:y", &x, &rows, &H, &w, &w_fp32,
               &round_first, &eps_obj, &y) ||
        !holds(fn, "x", &x, size3(rows, H, 2)) || !holds(fn, "w", &w, size3(H, w_fp32 ? 4 : 2, 1)) ||
        !holds(fn, "y", &y, size3(rows, H, 2)))
        return NULL;
    if (round_first && w_fp32)
        return PyErr_Format(PyExc_ValueError, "rms_norm(): round_first takes a bf16 weight");
    double eps = PyFloat_AsDouble(eps_obj);
    if (eps == -1.0 && PyErr_Occurred())
        return NULL;
    NOGIL(dep_rms_norm((const uint16_t *)x.ptr, rows, H, w.ptr, (int)w_fp32, (int)round_first, (float)eps,
                       (uint16_t *)y.ptr));
    Py_RETURN_NONE;
}

METHOD(add_rms_norm) {
    const char *fn = "add_rms_norm";
    Buf x, d, w, y;
    int64_t rows, H, w_fp32, round_first;
    PyObject *eps_obj;
    if (!parse(fn, args, nargs, "T:x T:d i:rows i:H T:w i:w_fp32 i:round_first O:eps T:y", &x, &d, &rows, &H, &w,
               &w_fp32, &round_first, &eps_obj, &y) ||
        !holds(fn, "x", &x, size3(rows, H, 2)) || !holds(fn, "d", &d, size3(rows, H, 2)) ||
        !holds(fn, "w", &w, size3(H, w_fp32 ? 4 : 2, 1)) || !holds(fn, "y", &y, size3(rows, H, 2)))
        return NULL;
    if (round_first && w_fp32)
        return PyErr_Format(PyExc_ValueError, "add_rms_norm(): round_first takes a bf16 weight");
    double eps = PyFloat_AsDouble(eps_obj);
    if (eps == -1.0 && PyErr_Occurred())
        return NULL;
    NOGIL(dep_add_rms_norm((uint16_t *)x.ptr, (const uint16_t *)d.ptr, rows, H, w.ptr, (int)w_fp32, (int)round_first,
                           (float)eps, (uint16_t *)y.ptr));
    Py_RETURN_NONE;
}

/* Whether H query heads, KV key/value heads of D values fit a row of W (bf16: item 2, fp32: 4). */
static int head_layout(const char *fn, int64_t W, int64_t H, int64_t KV, int64_t D, int64_t extra) {
    if (H > 0 && KV > 0 && H % KV == 0 && D > 0 && (H + extra * KV) * D <= W)
        return 1;
    PyErr_Format(PyExc_ValueError, "%s(): %lld query and %lld key/value heads of %lld do not fit rows of %lld", fn,
                 (long long)H, (long long)KV, (long long)D, (long long)W);
    return 0;
}

METHOD(qk_norm_rope) {
    const char *fn = "qk_norm_rope";
    Buf qkv, q_w, k_w, cos, sin;
    int64_t bf16, T, W, H, KV, D, rd;
    PyObject *eps_obj;
    if (!parse(fn, args, nargs, "i:bf16 T:qkv i:T i:W i:H i:KV i:D t:q_w t:k_w O:eps T:cos T:sin i:rd", &bf16, &qkv,
               &T, &W, &H, &KV, &D, &q_w, &k_w, &eps_obj, &cos, &sin, &rd))
        return NULL;
    int64_t item = bf16 ? 2 : 4;
    if (!head_layout(fn, W, H, KV, D, 1) || !holds(fn, "qkv", &qkv, size3(T, W, item)) ||
        !holds(fn, "cos", &cos, size3(T, rd, item)) || !holds(fn, "sin", &sin, size3(T, rd, item)) ||
        (q_w.ptr && !holds(fn, "q_w", &q_w, size3(D, item, 1))) || (k_w.ptr && !holds(fn, "k_w", &k_w, size3(D, item, 1))))
        return NULL;
    if (rd < 0 || rd % 2 || rd > D || D > 1024 || (!q_w.ptr) != (!k_w.ptr))
        return PyErr_Format(PyExc_ValueError, "qk_norm_rope(): rd = %lld must be even and <= D = %lld <= 1024, with "
                            "both norm weights or neither", (long long)rd, (long long)D);
    double eps = PyFloat_AsDouble(eps_obj);
    if (eps == -1.0 && PyErr_Occurred())
        return NULL;
    NOGIL(dep_qk_norm_rope((int)bf16, qkv.ptr, T, W, H, KV, D, q_w.ptr, k_w.ptr, (float)eps, cos.ptr, sin.ptr, rd));
    Py_RETURN_NONE;
}

METHOD(decode_attention) {
    const char *fn = "decode_attention";
    Buf qkv, k_cache, v_cache, slots, table, pos, sinks, out;
    int64_t bf16, W, S, H, KV, D, MB, bs, window;
    PyObject *scale_obj;
    if (!parse(fn, args, nargs,
               "i:bf16 T:qkv i:W i:S i:H i:KV i:D T:k_cache T:v_cache T:slots T:table i:MB i:bs T:pos i:window "
               "t:sinks O:scale T:out",
               &bf16, &qkv, &W, &S, &H, &KV, &D, &k_cache, &v_cache, &slots, &table, &MB, &bs, &pos, &window, &sinks,
               &scale_obj, &out))
        return NULL;
    int64_t item = bf16 ? 2 : 4, slot_bytes = size3(KV, D, item);
    if (!head_layout(fn, W, H, KV, D, 2) || !holds(fn, "qkv", &qkv, size3(S, W, item)) ||
        !holds(fn, "slots", &slots, size3(S, 8, 1)) || !holds(fn, "table", &table, size3(S, MB, 8)) ||
        !holds(fn, "pos", &pos, size3(S, 8, 1)) || !holds(fn, "out", &out, size3(S, H * D, item)) ||
        (sinks.ptr && !holds(fn, "sinks", &sinks, size3(H, 4, 1))))
        return NULL;
    if (bs < 1 || window < 0 || k_cache.nbytes != v_cache.nbytes || slot_bytes <= 0)
        return PyErr_Format(PyExc_ValueError, "decode_attention(): block size %lld, window %lld or the caches' sizes "
                            "are wrong", (long long)bs, (long long)window);
    int64_t num_slots = k_cache.nbytes / slot_bytes;
    if (!inside((const int64_t *)slots.ptr, S, num_slots) || !inside((const int64_t *)table.ptr, S * MB, num_slots / bs) ||
        !inside((const int64_t *)pos.ptr, S, MB * bs))
        return PyErr_Format(PyExc_IndexError, "decode_attention(): a slot, block or position is outside the cache");
    double scale = PyFloat_AsDouble(scale_obj);
    if (scale == -1.0 && PyErr_Occurred())
        return NULL;
    int done;
    NOGIL(done = dep_decode_attention((int)bf16, qkv.ptr, W, S, H, KV, D, k_cache.ptr, v_cache.ptr,
                                      (const int64_t *)slots.ptr, (const int64_t *)table.ptr, MB, bs,
                                      (const int64_t *)pos.ptr, window, (const float *)sinks.ptr, (float)scale,
                                      out.ptr));
    if (!done)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

METHOD(place_scales) {
    const char *fn = "place_scales";
    Buf rows, pair_row, pair_pos, out;
    int64_t num_rows, row_bytes, scale_off, k, num_local, cap, groups, repeat;
    if (!parse(fn, args, nargs,
               "T:rows i:num_rows i:row_bytes i:scale_off T:pair_row T:pair_pos i:k T:out i:num_local i:cap "
               "i:groups i:repeat",
               &rows, &num_rows, &row_bytes, &scale_off, &pair_row, &pair_pos, &k, &out, &num_local, &cap, &groups,
               &repeat))
        return NULL;
    if (!holds(fn, "rows", &rows, size3(num_rows, row_bytes, 1)) ||
        !holds(fn, "pair_row", &pair_row, size3(k, 8, 1)) ||
        !holds(fn, "pair_pos", &pair_pos, size3(k, 8, 1)) ||
        !holds(fn, "out", &out, size3(size3(num_local, groups, 1), cap, 4)) ||
        !field(fn, "scales", scale_off, size3(repeat ? 1 : groups, 4, 1), row_bytes))
        return NULL;
    if (!inside((const int64_t *)pair_pos.ptr, k, num_local * cap) ||
        !inside((const int64_t *)pair_row.ptr, k, num_rows))
        return PyErr_Format(PyExc_IndexError, "place_scales: a pair outside the rows or the layout");
    NOGIL(dep_place_scales(rows.ptr, row_bytes, scale_off, (const int64_t *)pair_row.ptr,
                                    (const int64_t *)pair_pos.ptr, k, (float *)out.ptr, cap, groups, (int)repeat));
    Py_RETURN_NONE;
}

METHOD(place_pairs) {
    const char *fn = "place_pairs";
    Buf x, token, expert, recv, src_info, pos, counts;
    int64_t x_rows, data_bytes, n, num_local, cap, num_ranks, src;
    if (!parse(fn, args, nargs,
               "T:x i:x_rows i:data_bytes T:token T:expert i:n i:num_local i:cap i:num_ranks i:src T:recv "
               "T:src_info T:pos T:counts",
               &x, &x_rows, &data_bytes, &token, &expert, &n, &num_local, &cap, &num_ranks, &src, &recv, &src_info,
               &pos, &counts))
        return NULL;
    if (!holds(fn, "x", &x, size3(x_rows, data_bytes, 1)) || !holds(fn, "token", &token, size3(n, 8, 1)) ||
        !holds(fn, "expert", &expert, size3(n, 8, 1)) ||
        !masked_out(fn, &recv, &src_info, &pos, &counts, data_bytes, num_local, cap, num_ranks, src))
        return NULL;
    if (!inside((const int64_t *)token.ptr, n, x_rows))
        return PyErr_Format(PyExc_IndexError, "place_pairs: a token is outside [0, %lld)", (long long)x_rows);
    int rc;
    NOGIL(rc = dep_place_pairs(x.ptr, data_bytes, (const int64_t *)token.ptr, (const int64_t *)expert.ptr, n,
                                        num_local, cap, num_ranks, src, recv.ptr, (int32_t *)src_info.ptr,
                                        (int64_t *)pos.ptr, (int64_t *)counts.ptr));
    if (rc)
        return PyErr_Format(PyExc_ValueError, rc == -1 ? "own pairs name a local expert outside the layout"
                                                       : "own pairs exceed an expert's R * N rows");
    Py_RETURN_NONE;
}

METHOD(layout_range) {
    const char *fn = "layout_range";
    Buf counts, out, recv_count;
    int64_t num_local, num_ranks, me;
    if (!parse(fn, args, nargs, "T:counts i:num_local i:num_ranks i:me T:out T:recv_count", &counts, &num_local,
               &num_ranks, &me, &out, &recv_count))
        return NULL;
    if (me < 0 || me >= num_ranks)
        return PyErr_Format(PyExc_ValueError, "%s(): rank %lld is outside [0, %lld)", fn, (long long)me,
                            (long long)num_ranks);
    if (!holds(fn, "counts", &counts, size3(num_local, num_ranks, 8)) ||
        !holds(fn, "out", &out, size3(num_local, num_ranks, 8)) ||
        !holds(fn, "recv_count", &recv_count, size3(num_local, 4, 1)))
        return NULL;
    NOGIL(dep_layout_range((const int64_t *)counts.ptr, num_local, num_ranks, me, (int64_t *)out.ptr,
                                    (int32_t *)recv_count.ptr));
    Py_RETURN_NONE;
}

METHOD(return_rows) {
    const char *fn = "return_rows";
    Buf layout_range, mask, rows, per_src;
    int64_t num_local, num_ranks, n;
    if (!parse(fn, args, nargs, "T:layout_range i:num_local i:num_ranks i:n T:mask T:rows T:per_src", &layout_range,
               &num_local, &num_ranks, &n, &mask, &rows, &per_src))
        return NULL;
    if (!holds(fn, "layout_range", &layout_range, size3(num_local, num_ranks, 8)) ||
        !holds(fn, "mask", &mask, size3(num_ranks, 1, 1)) ||
        !holds(fn, "rows", &rows, size3(size3(num_local, num_ranks, n), 8, 1)) ||
        !holds(fn, "per_src", &per_src, size3(num_ranks, 8, 1)))
        return NULL;
    int64_t k;
    NOGIL(k = dep_return_rows((const int64_t *)layout_range.ptr, num_local, num_ranks, n, mask.ptr,
                                       (int64_t *)rows.ptr, (int64_t *)per_src.ptr));
    return PyLong_FromLongLong(k);
}

/* place_flat's blocks ((source, rows [n][row_bytes] uint8) pairs) as the loop's tables: 3 * nb int64 (addresses,
 * row counts, sources), a new array, or NULL with an exception set. */
static int64_t *block_table(const char *fn, PyObject *blocks, int64_t row_bytes, Py_ssize_t *nb) {
    PyObject *seq = PySequence_Fast(blocks, "place_flat(): blocks must be a list of (source, rows) pairs");
    if (!seq)
        return NULL;
    *nb = PySequence_Fast_GET_SIZE(seq);
    int64_t *table = PyMem_Malloc(sizeof(int64_t) * (size_t)(3 * *nb + 1));
    int ok = table != NULL;
    if (!ok)
        PyErr_NoMemory();
    for (Py_ssize_t b = 0; ok && b < *nb; b++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(seq, b);
        Buf rows;
        ok = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2;
        if (!ok) {
            PyErr_Format(PyExc_TypeError, "%s(): blocks must be a list of (source, rows) pairs", fn);
            break;
        }
        int64_t src = PyLong_AsLongLong(PyTuple_GET_ITEM(pair, 0));
        ok = !(src == -1 && PyErr_Occurred()) && to_buf(PyTuple_GET_ITEM(pair, 1), &rows, fn, "a block's rows");
        if (ok && rows.nbytes % row_bytes) {
            PyErr_Format(PyExc_ValueError, "%s(): a block's rows are not whole rows of %lld bytes", fn,
                         (long long)row_bytes);
            ok = 0;
        }
        if (ok)
            table[b] = (int64_t)(uintptr_t)rows.ptr, table[*nb + b] = rows.nbytes / row_bytes, table[2 * *nb + b] = src;
    }
    Py_DECREF(seq);
    if (!ok)
        PyMem_Free(table);
    return ok ? table : NULL;
}

METHOD(place_flat) {
    const char *fn = "place_flat";
    Buf expand_x, scales, assist, expand_scales, counts;
    PyObject *blocks;
    int64_t row_bytes, data_bytes, scale_off, scale_bytes, token_off, slot_off, num_slots, weight_off, num_local,
        num_ranks, cap;
    if (!parse(fn, args, nargs,
               "O:blocks i:row_bytes i:data_bytes i:scale_off i:scale_bytes i:token_off i:slot_off i:num_slots "
               "i:weight_off i:num_local i:num_ranks i:cap T:expand_x t:scales T:assist t:expand_scales T:counts",
               &blocks, &row_bytes, &data_bytes, &scale_off, &scale_bytes, &token_off, &slot_off, &num_slots,
               &weight_off, &num_local, &num_ranks, &cap, &expand_x, &scales, &assist, &expand_scales, &counts))
        return NULL;
    int64_t slots = size3(num_slots, 4, 1);
    if (row_bytes < 1)
        return PyErr_Format(PyExc_ValueError, "%s(): row_bytes must be >= 1", fn);
    if (!field(fn, "data", 0, data_bytes, row_bytes) ||
        !field(fn, "token", token_off, 4, row_bytes) || !field(fn, "slots", slot_off, slots, row_bytes) ||
        (scale_bytes && !field(fn, "scales", scale_off, scale_bytes, row_bytes)) ||
        (weight_off >= 0 && !field(fn, "weights", weight_off, slots, row_bytes)) ||
        !holds(fn, "expand_x", &expand_x, size3(cap, data_bytes, 1)) ||
        (scale_bytes && !holds(fn, "scales", &scales, size3(cap, scale_bytes, 1))) ||
        !holds(fn, "assist", &assist, size3(cap, 12, 1)) ||
        (weight_off >= 0 && !holds(fn, "expand_scales", &expand_scales, size3(cap, 4, 1))) ||
        !holds(fn, "counts", &counts, size3(num_local, num_ranks, 8)))
        return NULL;
    Py_ssize_t nb;
    int64_t *table = block_table(fn, blocks, row_bytes, &nb), k;
    if (!table)
        return NULL;
    NOGIL(k = dep_place_flat(table, table + nb, table + 2 * nb, nb, row_bytes, data_bytes, scale_off,
                                      scale_bytes, token_off, slot_off, num_slots, weight_off, num_local, num_ranks,
                                      cap, expand_x.ptr, scales.ptr, (int32_t *)assist.ptr, (float *)expand_scales.ptr,
                                      (int64_t *)counts.ptr));
    PyMem_Free(table);
    if (k == -1)
        return PyErr_Format(PyExc_ValueError, "dispatch rows name a local expert or source outside the layout");
    if (k == -3)
        return PyErr_NoMemory();
    return PyLong_FromLongLong(k);
}

METHOD(has_dtype) {
    int64_t dtype;
    if (!parse("has_dtype", args, nargs, "i:dtype", &dtype))
        return NULL;
    return PyBool_FromLong(dtype >= 0 && dtype <= 2 && dep_has_dtype((int)dtype));
}

#define ENTRY(name, doc) {#name, (PyCFunction)(void (*)(void))py_##name, METH_FASTCALL, doc}
static PyMethodDef methods[] = {
    ENTRY(accumulate, "acc[token[i]] += weight[i] * x[index[i]] in fp32 (see kernels.accumulate)"),
    ENTRY(accumulate_rows, "the slot-ordered fp32 sum over rows of several tensors (see kernels.accumulate_rows)"),
    ENTRY(sum_tokens, "token-ordered fp32 sums of rows, rounded into out (see kernels.sum_tokens)"),
    ENTRY(place, "the masked placement of packed dispatch rows (see kernels.place)"),
    ENTRY(check_ids, "whether top-k ids are in range with no repeats (see kernels.ids_ok)"),
    ENTRY(plan, "the dispatch plan of top-k ids (see kernels.plan)"),
    ENTRY(pack, "dispatch rows without quantization (see kernels.pack)"),
    ENTRY(pack_int8, "dispatch rows with per-token int8 (see kernels.pack_int8)"),
    ENTRY(pack_fp8, "dispatch rows in DeepEP's fp8 (see kernels.pack_fp8)"),
    ENTRY(to_e4m3, "the float -> e4m3fn cast (see kernels.to_e4m3)"),
    ENTRY(gather, "out[i] = x[index[i]] with streaming stores (see kernels.gather)"),
    ENTRY(expert_mm, "the bf16 expert matmul of the grouped layout (see kernels.expert_mm)"),
    ENTRY(rms_norm, "RMSNorm of bf16 rows as transformers (see kernels.rms_norm)"),
    ENTRY(add_rms_norm, "the residual add and RMSNorm of bf16 rows (see kernels.rms_norm)"),
    ENTRY(qk_norm_rope, "q / k norms and rope of a fused projection, in place (see kernels.rope)"),
    ENTRY(decode_attention, "a decode batch's paged attention (see kernels.attention)"),
    ENTRY(place_scales, "the masked layout's scales (see kernels.place_scales)"),
    ENTRY(place_pairs, "the masked placement of this rank's own pairs (see kernels.place_pairs)"),
    ENTRY(layout_range, "the masked layout's block table (see kernels.layout_range)"),
    ENTRY(return_rows, "combine's return rows (see kernels.return_rows)"),
    ENTRY(place_flat, "the flat layout's placement (see kernels.place_flat)"),
    ENTRY(has_dtype, "whether the sums and packers take rows of this dtype code"),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu", "deep_ep_npu's checked CPU kernels", -1, methods};

PyMODINIT_FUNC PyInit__cpu(void) {
    const char *names[] = {"is_cpu", "is_contiguous", "data_ptr", "nbytes", "shape", "stride", "element_size"};
    PyObject **slots[] = {&s_is_cpu, &s_is_contiguous, &s_data_ptr, &s_nbytes, &s_shape, &s_stride, &s_element_size};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (!(*slots[i] = PyUnicode_InternFromString(names[i])))
            return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddStringConstant(m, "SOURCES_SHA", DEP_SOURCES_SHA) < 0)
        Py_CLEAR(m);
    return m;
}
