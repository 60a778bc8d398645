/* One page pool of the grouped prefix cache (twin/sim/kvcache.py), its per-page loops in C.
 *
 * A pool is one cache family in one partition: `size` pages with a reference count each, an
 * optional content hash each, the free queue in eviction order and the `hash -> page` index.
 * `KvCacheManager` decides which pages move and in which order; a call here moves a whole run of
 * pages (a take, a release, a ring rewrite, a publication, a prefix lookup) so the cost per page
 * is a few array reads instead of Python bytecode.
 *
 * Free queue: an array with a moving head; freed pages append at the tail, takes pop the head, a
 * prefix hit pulls a page out from anywhere (leaving a hole, -1, that takes skip).  `pos` holds a
 * queued page's place, so a pull is O(1).  When the tail reaches the end the queue is compacted
 * (holes dropped, order kept): past the head it holds at most `size` pages, so an array of twice
 * the pool never overflows.
 *
 * Index: open addressing with linear probing over a power-of-two table of at least four times the
 * pool, holding page ids only (an entry's key is its page's hash).  An entry for hash h exists
 * only while its page carries h: changing or clearing a page's hash deletes the page's entry
 * (backward-shift deletion, no tombstones), so the index never holds more entries than the pool
 * has pages and a lookup's answer is always a page that caches the hash.
 *
 * Prompt hashes arrive as uint64 arrays (one per page size, computed once per request).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    Py_ssize_t size;            /* pages in the pool */
    Py_ssize_t itemsize;        /* 4: the buffer's stride (ref counts as int32) */
    int32_t *ref;
    uint64_t *hash;
    uint8_t *hashed;
    int32_t *q;                 /* free queue, q[head:tail], -1 = hole */
    int32_t *pos;               /* a queued page's index in q, else -1 */
    Py_ssize_t cap, head, tail, nfree, holes;
    int32_t *vals;              /* index slots: a page id (key: its hash), -1 = empty */
    size_t mask;
    Py_ssize_t nindex;
    long long evictions;        /* taken pages whose cached content went */
    PyObject *label;            /* "family pN", for error messages */
} Pool;

/* ---- index -------------------------------------------------------------------------------- */
static inline size_t slot_of(uint64_t h, size_t mask)
{
    /* the keys are hashes already; the finaliser spreads any structure in the low bits */
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    return (size_t)h & mask;
}

static inline int32_t idx_get(const Pool *p, uint64_t h)
{
    size_t i = slot_of(h, p->mask);
    int32_t v;
    while ((v = p->vals[i]) >= 0) {
        if (p->hash[v] == h)
            return v;
        i = (i + 1) & p->mask;
    }
    return -1;
}

/* page b (carrying hash h) becomes h's entry */
static inline void idx_put(Pool *p, uint64_t h, int32_t b)
{
    size_t i = slot_of(h, p->mask);
    int32_t v;
    while ((v = p->vals[i]) >= 0) {
        if (p->hash[v] == h) {
            p->vals[i] = b;
            return;
        }
        i = (i + 1) & p->mask;
    }
    p->vals[i] = b;
    p->nindex++;
}

/* delete the entry for `h` (if `only` >= 0: only while it is page `only`); returns whether it was
   there.  Must run while the entry's page still carries h. */
static int idx_del(Pool *p, uint64_t h, int32_t only)
{
    size_t mask = p->mask, i = slot_of(h, mask);
    int32_t v;
    while ((v = p->vals[i]) >= 0 && p->hash[v] != h)
        i = (i + 1) & mask;
    if (v < 0 || (only >= 0 && v != only))
        return 0;
    /* backward shift: pull later entries of the probe run into the hole unless their home slot
       lies cyclically in (hole, j] */
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if ((v = p->vals[j]) < 0)
            break;
        size_t k = slot_of(p->hash[v], mask);
        int stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            p->vals[i] = v;
            i = j;
        }
    }
    p->vals[i] = -1;
    p->nindex--;
    return 1;
}

static inline void clear_hash(Pool *p, int32_t b)
{
    if (p->hashed[b]) {
        p->hashed[b] = 0;
        idx_del(p, p->hash[b], b);
    }
}

/* page b caches hash h (the caller has found no entry for h) */
static inline void set_hash(Pool *p, int32_t b, uint64_t h)
{
    if (p->hashed[b])
        idx_del(p, p->hash[b], b);
    p->hash[b] = h;
    p->hashed[b] = 1;
    idx_put(p, h, b);
}

/* ---- free queue --------------------------------------------------------------------------- */
static void q_compact(Pool *p)
{
    Py_ssize_t w = 0;
    for (Py_ssize_t i = p->head; i < p->tail; i++) {
        int32_t b = p->q[i];
        if (b >= 0) {
            p->q[w] = b;
            p->pos[b] = (int32_t)w;
            w++;
        }
    }
    p->head = 0;
    p->tail = w;
    p->holes = 0;
}

static inline void q_push(Pool *p, int32_t b)
{
    if (p->tail == p->cap)
        q_compact(p);
    p->pos[b] = (int32_t)p->tail;
    p->q[p->tail++] = b;
    p->nfree++;
}

/* the head page (the caller has checked nfree > 0): one owner, its cached content evicted */
static inline int32_t q_take(Pool *p)
{
    while (p->q[p->head] < 0) {
        p->head++;
        p->holes--;
    }
    int32_t b = p->q[p->head++];
    p->pos[b] = -1;
    if (--p->nfree == 0)
        p->head = p->tail = p->holes = 0;
    p->ref[b] = 1;
    if (p->hashed[b]) {
        clear_hash(p, b);
        p->evictions++;
    }
    return b;
}

static inline void q_pull(Pool *p, int32_t b)
{
    p->q[p->pos[b]] = -1;
    p->pos[b] = -1;
    p->holes++;
    if (--p->nfree == 0)
        p->head = p->tail = p->holes = 0;
}

/* ---- argument helpers --------------------------------------------------------------------- */
static int get_u64(PyObject *o, uint64_t *out)
{
    if (PyLong_Check(o)) {
        *out = PyLong_AsUnsignedLongLong(o);
    } else {
        PyObject *i = PyNumber_Index(o);
        if (i == NULL)
            return -1;
        *out = PyLong_AsUnsignedLongLong(i);
        Py_DECREF(i);
    }
    return (*out == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
}

/* a C-contiguous 1-d array of uint64 (released with PyBuffer_Release) */
static int get_hashes(PyObject *o, Py_buffer *view)
{
    if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        goto bad;
    }
    const char *f = view->format;
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->ndim == 1 && view->itemsize == 8 && (strcmp(f, "Q") == 0 || strcmp(f, "L") == 0))
        return 0;
    PyBuffer_Release(view);
bad:
    PyErr_Format(PyExc_TypeError, "prompt hashes: a 1-d uint64 array (KvCacheManager.prompt_hashes), not %.100s",
                 Py_TYPE(o)->tp_name);
    return -1;
}

/* a page id of this pool, or -2 for None (an empty ring slot); -1 with an exception set */
static inline int32_t get_page(const Pool *p, PyObject *o)
{
    if (o == Py_None)
        return -2;
    long b = PyLong_AsLong(o);
    if (b == -1 && PyErr_Occurred())
        return -1;
    if (b < 0 || b >= p->size) {
        PyErr_Format(PyExc_IndexError, "%U: page %ld outside the pool of %zd", p->label, b, p->size);
        return -1;
    }
    return (int32_t)b;
}

static PyObject *tuple_of(const int32_t *v, Py_ssize_t n)
{
    PyObject *t = PyTuple_New(n);
    if (t == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLong(v[i]);
        if (x == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

/* a scratch buffer of n page ids (freed with PyMem_Free) */
static int32_t *scratch(Py_ssize_t n)
{
    int32_t *v = PyMem_Malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    if (v == NULL)
        PyErr_NoMemory();
    return v;
}

/* ---- type ---------------------------------------------------------------------------------- */
static void Pool_dealloc(Pool *p)
{
    PyMem_Free(p->ref);
    PyMem_Free(p->hash);
    PyMem_Free(p->hashed);
    PyMem_Free(p->q);
    PyMem_Free(p->pos);
    PyMem_Free(p->vals);
    Py_XDECREF(p->label);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* the arrays are made with the object (tp_new, no tp_init), so no Pool exists without them */
static PyObject *Pool_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *names[] = {"size", "label", NULL};
    Py_ssize_t size;
    PyObject *label;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nU", names, &size, &label))
        return NULL;
    if (size < 0 || size > INT32_MAX / 4) {
        PyErr_Format(PyExc_ValueError, "pool size %zd: must be 0..%d", size, INT32_MAX / 4);
        return NULL;
    }
    Pool *p = (Pool *)type->tp_alloc(type, 0);       /* zeroed: dealloc frees what was made */
    if (p == NULL)
        return NULL;
    size_t m = 16;
    while (m < 4 * (size_t)size)
        m <<= 1;
    p->size = size;
    p->itemsize = sizeof(int32_t);
    p->cap = 2 * size + 16;
    p->ref = PyMem_Calloc((size_t)size + 1, sizeof(int32_t));
    p->hash = PyMem_Calloc((size_t)size + 1, sizeof(uint64_t));
    p->hashed = PyMem_Calloc((size_t)size + 1, 1);
    p->q = PyMem_Malloc(sizeof(int32_t) * (size_t)p->cap);
    p->pos = PyMem_Malloc(sizeof(int32_t) * ((size_t)size + 1));
    p->vals = PyMem_Malloc(sizeof(int32_t) * m);
    if (!p->ref || !p->hash || !p->hashed || !p->q || !p->pos || !p->vals) {
        Py_DECREF(p);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t b = 0; b < size; b++) {
        p->q[b] = (int32_t)b;
        p->pos[b] = (int32_t)b;
    }
    memset(p->vals, 0xff, sizeof(int32_t) * m);
    p->mask = m - 1;
    p->head = p->holes = p->nindex = 0;
    p->tail = p->nfree = size;
    p->evictions = 0;
    Py_INCREF(label);
    p->label = label;
    return (PyObject *)p;
}

/* ---- methods ------------------------------------------------------------------------------- */
static PyObject *Pool_take(Pool *p, PyObject *arg)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0 || n > p->nfree) {
        PyErr_Format(PyExc_RuntimeError, "%U: take %zd pages of %zd free", p->label, n, p->nfree);
        return NULL;
    }
    PyObject *t = PyTuple_New(n);
    if (t == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLong(q_take(p));
        if (x == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

/* one reference fewer on each page of `seq` (None: no page); the pages left unreferenced join the
   free queue's tail in order, hashes kept, and are appended to `freed` when it is not NULL */
static int unref_seq(Pool *p, PyObject *seq, PyObject *freed)
{
    PyObject *fast = PySequence_Fast(seq, "pages: a sequence");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = get_page(p, items[i]);
        if (b == -2)
            continue;
        if (b < 0)
            goto fail;
        int32_t r = --p->ref[b];
        if (r == 0) {
            q_push(p, b);
            if (freed != NULL && PyList_Append(freed, items[i]) < 0)
                goto fail;
        } else if (r < 0) {
            PyErr_Format(PyExc_AssertionError, "%U block %d: negative ref count", p->label, b);
            goto fail;
        }
    }
    Py_DECREF(fast);
    return 0;
fail:
    Py_DECREF(fast);
    return -1;
}

static PyObject *Pool_release(Pool *p, PyObject *args)
{
    PyObject *seq;
    int want;
    if (!PyArg_ParseTuple(args, "Op", &seq, &want))
        return NULL;
    PyObject *freed = want ? PyList_New(0) : NULL;
    if (want && freed == NULL)
        return NULL;
    if (unref_seq(p, seq, freed) < 0) {
        Py_XDECREF(freed);
        return NULL;
    }
    if (freed == NULL)
        Py_RETURN_NONE;
    return freed;
}

static PyObject *Pool_hold(Pool *p, PyObject *args)
{
    PyObject *seq;
    int want;
    if (!PyArg_ParseTuple(args, "Op", &seq, &want))
        return NULL;
    PyObject *fast = PySequence_Fast(seq, "pages: a sequence");
    if (fast == NULL)
        return NULL;
    PyObject *pulled = want ? PyList_New(0) : NULL;
    if (want && pulled == NULL)
        goto fail;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = get_page(p, items[i]);
        if (b == -2)
            continue;
        if (b < 0)
            goto fail;
        if (p->ref[b] == 0) {
            if (p->pos[b] < 0) {
                PyErr_Format(PyExc_AssertionError, "%U block %d: unreferenced but not queued", p->label, b);
                goto fail;
            }
            q_pull(p, b);
            if (pulled != NULL && PyList_Append(pulled, items[i]) < 0)
                goto fail;
        }
        p->ref[b]++;
    }
    Py_DECREF(fast);
    if (pulled == NULL)
        Py_RETURN_NONE;
    return pulled;
fail:
    Py_DECREF(fast);
    Py_XDECREF(pulled);
    return NULL;
}

static PyObject *Pool_rewrite(Pool *p, PyObject *args)
{
    PyObject *old, *held;
    int want;
    if (!PyArg_ParseTuple(args, "OOp", &old, &held, &want))
        return NULL;
    PyObject *fo = PySequence_Fast(old, "old pages: a sequence");
    if (fo == NULL)
        return NULL;
    PyObject *fh = NULL, *freed = NULL, *out = NULL;
    int32_t *nv = NULL, *ob = NULL, *kv = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fo);
    PyObject **ov = PySequence_Fast_ITEMS(fo);
    if (held != Py_None) {
        fh = PySequence_Fast(held, "held counts: a sequence");
        if (fh == NULL || PySequence_Fast_GET_SIZE(fh) != n) {
            if (fh != NULL)
                PyErr_SetString(PyExc_ValueError, "held counts: one per rewritten slot");
            goto done;
        }
    }
    if (want && (freed = PyList_New(0)) == NULL)
        goto done;
    if ((nv = scratch(n)) == NULL || (ob = scratch(n)) == NULL || (kv = scratch(n)) == NULL)
        goto done;
    /* every argument read and checked before the pool changes: a refused call leaves it as it was */
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = get_page(p, ov[i]);
        if (b < 0) {
            if (b == -2)
                PyErr_Format(PyExc_ValueError, "%U: a ring rewrite over an empty slot", p->label);
            goto done;
        }
        long k = 0;
        if (fh != NULL) {
            k = PyLong_AsLong(PySequence_Fast_GET_ITEM(fh, i));
            if (k == -1 && PyErr_Occurred())
                goto done;
            if (k < 0 || k > INT32_MAX / 2) {
                PyErr_Format(PyExc_ValueError, "%U: held count %ld of a ring slot", p->label, k);
                goto done;
            }
        }
        ob[i] = b;
        kv[i] = (int32_t)k;
    }
    int short_ = p->nfree < n;
    long long detaches = 0;
    if (!short_) {
        /* the pops reach only pages already queued, so the pages freed below (appended at the tail)
           cannot be among them: popping first is the order of interleaving */
        for (Py_ssize_t i = 0; i < n; i++)
            nv[i] = q_take(p);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = ob[i], k = kv[i];
        int32_t r = p->ref[b];
        detaches += (r > 1 || k > 0);
        r += k - 1;
        if (r < 0) {
            PyErr_Format(PyExc_AssertionError, "%U block %d: negative ref count", p->label, b);
            goto done;
        }
        p->ref[b] = r;
        if (r == 0) {
            q_push(p, b);
            if (freed != NULL && PyList_Append(freed, ov[i]) < 0)
                goto done;
        }
        if (short_) {
            /* the queue may run dry: a page freed by this rewrite is taken again, in order */
            if (p->nfree == 0) {
                PyErr_Format(PyExc_RuntimeError, "%U: a ring rewrite with no free page", p->label);
                goto done;
            }
            nv[i] = q_take(p);
        }
    }
    PyObject *nt = tuple_of(nv, n);
    if (nt == NULL)
        goto done;
    out = Py_BuildValue("(NOL)", nt, freed ? freed : Py_None, detaches);
done:
    PyMem_Free(nv);
    PyMem_Free(ob);
    PyMem_Free(kv);
    Py_DECREF(fo);
    Py_XDECREF(fh);
    Py_XDECREF(freed);
    return out;
}

static PyObject *Pool_publish(Pool *p, PyObject *args)
{
    PyObject *table, *hashes;
    Py_ssize_t a, n, ring, h0;
    if (!PyArg_ParseTuple(args, "OnnnOn", &table, &a, &n, &ring, &hashes, &h0))
        return NULL;
    PyObject *ft = PySequence_Fast(table, "table: a sequence");
    if (ft == NULL)
        return NULL;
    Py_buffer hb;
    if (get_hashes(hashes, &hb) < 0) {
        Py_DECREF(ft);
        return NULL;
    }
    const uint64_t *hv = hb.buf;
    Py_ssize_t lt = PySequence_Fast_GET_SIZE(ft), lh = hb.shape[0];
    PyObject **tv = PySequence_Fast_ITEMS(ft);
    PyObject *out = NULL;
    if (a < 0 || n < 0 || h0 < 0 || h0 > lh || n > lh - h0
        || (ring > 0 ? (ring > lt || a >= ring || n > ring) : (a > lt || n > lt - a))) {
        PyErr_Format(PyExc_IndexError, "%U: publication of slots %zd+%zd (ring %zd) past the table or hashes",
                     p->label, a, n, ring);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t s = a + i;
        if (ring > 0 && s >= ring)
            s -= ring;
        int32_t b = get_page(p, tv[s]);
        if (b == -2)
            continue;
        if (b < 0)
            goto done;
        uint64_t h = hv[h0 + i];
        int32_t owner = idx_get(p, h);
        if (owner < 0)
            set_hash(p, b, h);           /* no live owner: this page caches it */
        else if (owner != b)
            clear_hash(p, b);            /* duplicate content: the index keeps the first owner */
    }
    out = Py_NewRef(Py_None);
done:
    Py_DECREF(ft);
    PyBuffer_Release(&hb);
    return out;
}

static PyObject *Pool_fresh(Pool *p, PyObject *args)
{
    PyObject *table, *pins;
    Py_ssize_t s0, m, ring;
    if (!PyArg_ParseTuple(args, "OnnnO", &table, &s0, &m, &ring, &pins))
        return NULL;
    PyObject *ft = PySequence_Fast(table, "table: a sequence");
    if (ft == NULL)
        return NULL;
    PyObject *fp = PySequence_Fast(pins, "pinned tables: a sequence");
    if (fp == NULL) {
        Py_DECREF(ft);
        return NULL;
    }
    Py_ssize_t lt = PySequence_Fast_GET_SIZE(ft), np = PySequence_Fast_GET_SIZE(fp), need = 0;
    PyObject **tv = PySequence_Fast_ITEMS(ft), *out = NULL;
    if (ring <= 0 || s0 < 0 || m < 0 || s0 > PY_SSIZE_T_MAX - m) {
        PyErr_Format(PyExc_ValueError, "%U: ring slots %zd+%zd of a ring of %zd", p->label, s0, m, ring);
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        Py_ssize_t s = (s0 + i) % ring;
        if (s >= lt)
            continue;
        int32_t b = get_page(p, tv[s]);
        if (b == -2)
            continue;
        if (b < 0)
            goto done;
        if (p->ref[b] > 1) {
            need++;
            continue;
        }
        for (Py_ssize_t k = 0; k < np; k++) {
            PyObject *pt = PySequence_Fast_GET_ITEM(fp, k);
            if (!PyTuple_Check(pt)) {
                PyErr_SetString(PyExc_TypeError, "pinned tables: tuples of page ids");
                goto done;
            }
            if (s < PyTuple_GET_SIZE(pt)) {
                PyObject *x = PyTuple_GET_ITEM(pt, s);
                if (x == Py_None)
                    continue;
                long y = x == tv[s] ? b : PyLong_AsLong(x);
                if (y == -1 && PyErr_Occurred())
                    goto done;
                if (y == b) {
                    need++;
                    break;
                }
            }
        }
    }
    if (!PyErr_Occurred())
        out = PyLong_FromSsize_t(need);
done:
    Py_DECREF(ft);
    Py_DECREF(fp);
    return out;
}

static PyObject *Pool_hits(Pool *p, PyObject *args)
{
    PyObject *hashes;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "On", &hashes, &limit))
        return NULL;
    Py_buffer hb;
    if (get_hashes(hashes, &hb) < 0)
        return NULL;
    const uint64_t *hv = hb.buf;
    Py_ssize_t i = 0;
    if (limit > hb.shape[0])
        limit = hb.shape[0];
    while (i < limit && idx_get(p, hv[i]) >= 0)
        i++;
    PyBuffer_Release(&hb);
    return PyLong_FromSsize_t(i);
}

/* the live owner of each hash lo..hi-1: a tuple, or None if `strict` is false and one is missing
   (strict: KeyError) */
static PyObject *owners_of(Pool *p, PyObject *hashes, Py_ssize_t lo, Py_ssize_t hi, int strict)
{
    Py_buffer hb;
    if (get_hashes(hashes, &hb) < 0)
        return NULL;
    const uint64_t *hv = hb.buf;
    PyObject *out = NULL;
    int32_t *v = NULL;
    if (lo < 0 || hi > hb.shape[0]) {
        PyErr_Format(PyExc_IndexError, "%U: hashes %zd..%zd past the prompt's pages", p->label, lo, hi);
        goto done;
    }
    Py_ssize_t n = hi > lo ? hi - lo : 0;
    if ((v = scratch(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h = hv[lo + i];
        v[i] = idx_get(p, h);
        if (v[i] < 0) {
            if (strict)
                PyErr_Format(PyExc_KeyError, "%U: no cached page for hash %llu (attach past the lookup's hit)",
                             p->label, (unsigned long long)h);
            else
                out = Py_NewRef(Py_None);
            goto done;
        }
    }
    out = tuple_of(v, n);
done:
    PyMem_Free(v);
    PyBuffer_Release(&hb);
    return out;
}
static PyObject *Pool_owners(Pool *p, PyObject *args)
{
    PyObject *hashes;
    Py_ssize_t lo, hi;
    if (!PyArg_ParseTuple(args, "Onn", &hashes, &lo, &hi))
        return NULL;
    return owners_of(p, hashes, lo, hi, 1);
}

static PyObject *Pool_cached(Pool *p, PyObject *args)
{
    PyObject *hashes;
    Py_ssize_t lo, hi;
    if (!PyArg_ParseTuple(args, "Onn", &hashes, &lo, &hi))
        return NULL;
    PyObject *t = owners_of(p, hashes, lo, hi, 0);
    if (t == NULL)
        return NULL;
    int all = t != Py_None;
    Py_DECREF(t);
    return PyBool_FromLong(all);
}

static PyObject *Pool_owner(Pool *p, PyObject *arg)
{
    uint64_t h;
    if (get_u64(arg, &h) < 0)
        return NULL;
    int32_t b = idx_get(p, h);
    if (b < 0)
        Py_RETURN_NONE;
    return PyLong_FromLong(b);
}

static PyObject *Pool_unindex(Pool *p, PyObject *arg)
{
    uint64_t h;
    if (get_u64(arg, &h) < 0)
        return NULL;
    if (!idx_del(p, h, -1)) {
        PyErr_SetObject(PyExc_KeyError, arg);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Pool_index_size(Pool *p, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSsize_t(p->nindex);
}

static PyObject *Pool_hashes(Pool *p, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(p->size);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t b = 0; b < p->size; b++) {
        PyObject *x = p->hashed[b] ? PyLong_FromUnsignedLongLong(p->hash[b]) : Py_NewRef(Py_None);
        if (x == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, b, x);
    }
    return out;
}

static PyObject *free_list(Pool *p)
{
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = p->head; i < p->tail; i++) {
        if (p->q[i] < 0)
            continue;
        PyObject *x = PyLong_FromLong(p->q[i]);
        if (x == NULL || PyList_Append(out, x) < 0) {
            Py_XDECREF(x);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(x);
    }
    return out;
}

static PyObject *Pool_iter(Pool *p)
{
    PyObject *l = free_list(p);
    if (l == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(l);
    Py_DECREF(l);
    return it;
}

static Py_ssize_t Pool_len(Pool *p)
{
    return p->nfree;
}

static int Pool_contains(Pool *p, PyObject *o)
{
    if (!PyLong_Check(o))
        return 0;
    long b = PyLong_AsLong(o);
    if (b == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return b >= 0 && b < p->size && p->pos[b] >= 0;
}

static int Pool_getbuffer(Pool *p, Py_buffer *view, int flags)
{
    if (flags & PyBUF_WRITABLE) {
        PyErr_SetString(PyExc_BufferError, "a pool's reference counts are read-only outside the pool");
        return -1;
    }
    view->obj = Py_NewRef((PyObject *)p);
    view->buf = p->ref;
    view->len = p->size * (Py_ssize_t)sizeof(int32_t);
    view->readonly = 1;
    view->itemsize = sizeof(int32_t);
    view->format = (flags & PyBUF_FORMAT) ? "i" : NULL;
    view->ndim = 1;
    view->shape = (flags & PyBUF_ND) ? &p->size : NULL;
    view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? &p->itemsize : NULL;
    view->suboffsets = NULL;
    view->internal = NULL;
    return 0;
}

static PyObject *Pool_get_n(Pool *p, void *Py_UNUSED(c))
{
    return PyLong_FromSsize_t(p->nfree);
}

static PyObject *Pool_get_evictions(Pool *p, void *Py_UNUSED(c))
{
    return PyLong_FromLongLong(p->evictions);
}

static PyObject *Pool_repr(Pool *p)
{
    return PyUnicode_FromFormat("Pool(%U: %zd pages, %zd free, %zd indexed)", p->label, p->size, p->nfree, p->nindex);
}

static PyMethodDef Pool_methods[] = {
    {"take", (PyCFunction)Pool_take, METH_O,
     "take(n): pop n pages from the free-queue head, in order; each gets one owner and loses its hash."},
    {"release", (PyCFunction)Pool_release, METH_VARARGS,
     "release(pages, want): one reference fewer on each page (None skipped); the unreferenced ones join the "
     "free-queue tail in order, hashes kept, and are returned as a list when `want`."},
    {"hold", (PyCFunction)Pool_hold, METH_VARARGS,
     "hold(pages, want): one reference more on each page (None skipped); an unreferenced page is pulled out "
     "of the free queue (returned in order as a list when `want`)."},
    {"rewrite", (PyCFunction)Pool_rewrite, METH_VARARGS,
     "rewrite(old, held, want): ring slots overwritten: a new page per slot from the head, the owner's "
     "reference on each old page dropped and the pins' `held` counts (None: none) made explicit; returns "
     "(new pages, freed pages as a list or None, detaches)."},
    {"publish", (PyCFunction)Pool_publish, METH_VARARGS,
     "publish(table, a, n, ring, hashes, h0): hash table slots a..a+n-1 (mod `ring` when > 0) with hashes "
     "h0..h0+n-1: a page caches a hash that has no live owner; a duplicate of a live owner loses its hash."},
    {"fresh", (PyCFunction)Pool_fresh, METH_VARARGS,
     "fresh(table, s0, m, ring, pinned): of ring slots s0..s0+m-1 (mod `ring`) that the table has, how many "
     "hold a page that is shared (more than one reference) or held by one of the `pinned` tables in that slot."},
    {"hits", (PyCFunction)Pool_hits, METH_VARARGS,
     "hits(hashes, limit): how many leading hashes (at most `limit`) have a live owner."},
    {"owners", (PyCFunction)Pool_owners, METH_VARARGS,
     "owners(hashes, lo, hi): the live owner of each hash lo..hi-1 (KeyError if one has none)."},
    {"cached", (PyCFunction)Pool_cached, METH_VARARGS,
     "cached(hashes, lo, hi): whether every hash lo..hi-1 has a live owner."},
    {"owner", (PyCFunction)Pool_owner, METH_O, "owner(h): the page caching hash h, or None."},
    {"unindex", (PyCFunction)Pool_unindex, METH_O, "unindex(h): drop h's index entry (KeyError if none)."},
    {"index_size", (PyCFunction)Pool_index_size, METH_NOARGS, "index_size(): entries in the hash index."},
    {"hashes", (PyCFunction)Pool_hashes, METH_NOARGS, "hashes(): each page's hash, or None."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pool_getset[] = {
    {"n", (getter)Pool_get_n, NULL, "free pages", NULL},
    {"evictions", (getter)Pool_get_evictions, NULL, "taken pages whose cached content went", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Pool_as_sequence = {
    .sq_length = (lenfunc)Pool_len,
    .sq_contains = (objobjproc)Pool_contains,
};

static PyBufferProcs Pool_as_buffer = {
    .bf_getbuffer = (getbufferproc)Pool_getbuffer,
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "twin.sim._pages.Pool",
    .tp_doc = PyDoc_STR("Pool(size, label): one family's pages in one partition: ref counts (the buffer, int32), "
                        "hashes, the free queue (len, iteration in eviction order, `in`) and the hash index."),
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Pool_new,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_repr = (reprfunc)Pool_repr,
    .tp_iter = (getiterfunc)Pool_iter,
    .tp_methods = Pool_methods,
    .tp_getset = Pool_getset,
    .tp_as_sequence = &Pool_as_sequence,
    .tp_as_buffer = &Pool_as_buffer,
};

static PyObject *release_runs(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *pools, *runs;
    int want;
    if (!PyArg_ParseTuple(args, "OOp", &pools, &runs, &want))
        return NULL;
    PyObject *fp = PySequence_Fast(pools, "pools: a sequence of Pool");
    if (fp == NULL)
        return NULL;
    PyObject *fr = PySequence_Fast(runs, "runs: a sequence of (family, first slot, pages)");
    if (fr == NULL) {
        Py_DECREF(fp);
        return NULL;
    }
    PyObject *out = want ? PyList_New(0) : NULL, *freed = NULL;
    if (want && out == NULL)
        goto fail;
    Py_ssize_t np = PySequence_Fast_GET_SIZE(fp), nr = PySequence_Fast_GET_SIZE(fr);
    long cur = -1;
    for (Py_ssize_t i = 0; i < nr; i++) {
        PyObject *run = PySequence_Fast_GET_ITEM(fr, i);
        if (!PyTuple_Check(run) || PyTuple_GET_SIZE(run) != 3) {
            PyErr_SetString(PyExc_TypeError, "runs: each a (family, first slot, pages) tuple");
            goto fail;
        }
        long f = PyLong_AsLong(PyTuple_GET_ITEM(run, 0));
        if (f == -1 && PyErr_Occurred())
            goto fail;
        if (f < 0 || f >= np || !PyObject_TypeCheck(PySequence_Fast_GET_ITEM(fp, f), &PoolType)) {
            PyErr_Format(PyExc_IndexError, "runs: family %ld has no pool", f);
            goto fail;
        }
        if (want && f != cur) {
            if (freed != NULL && PyList_GET_SIZE(freed) > 0) {
                PyObject *pair = Py_BuildValue("(lO)", cur, freed);
                if (pair == NULL || PyList_Append(out, pair) < 0) {
                    Py_XDECREF(pair);
                    goto fail;
                }
                Py_DECREF(pair);
            }
            Py_XDECREF(freed);
            if ((freed = PyList_New(0)) == NULL)
                goto fail;
        }
        cur = f;
        if (unref_seq((Pool *)PySequence_Fast_GET_ITEM(fp, f), PyTuple_GET_ITEM(run, 2), freed) < 0)
            goto fail;
    }
    if (want && freed != NULL && PyList_GET_SIZE(freed) > 0) {
        PyObject *pair = Py_BuildValue("(lO)", cur, freed);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            goto fail;
        }
        Py_DECREF(pair);
    }
    Py_XDECREF(freed);
    Py_DECREF(fp);
    Py_DECREF(fr);
    if (!want)
        Py_RETURN_NONE;
    return out;
fail:
    Py_XDECREF(freed);
    Py_XDECREF(out);
    Py_DECREF(fp);
    Py_DECREF(fr);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"release_runs", release_runs, METH_VARARGS,
     "release_runs(pools, runs, want): for each (family, first slot, pages) run in order, `Pool.release` "
     "of its pages in `pools[family]`; when `want`, the freed pages as [(family, [pages])], one entry per "
     "stretch of runs of one family that freed any."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef pages_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_pages",
    .m_doc = "The grouped prefix cache's page pools (see twin/sim/kvcache.py).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__pages(void)
{
    if (PyType_Ready(&PoolType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&pages_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Pool", (PyObject *)&PoolType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
