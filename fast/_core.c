/* uniradix.fast._core: the hot loops of uniradix.fast.UnifiedRadixCache in C.
 *
 * What is here (fast/cache.py's module docstring has the why):
 *
 *   TreeNode   the tree node type, with the attribute names of the pure-Python TreeNode
 *              (children, parent, key, value, lock_ref, last_access_time, hit_count,
 *              extra_key, dev_children, id, ck; the `evicted` property, __lt__, __repr__).
 *              GC-aware: parent <-> children form cycles.
 *   match      the match_prefix walk, split, path stamps, heap push, concatenation.
 *   insert     the insert walk: touches, heap pushes, split, unevict, frees of duplicate
 *              slots (one range per node, as upstream; a single range straight to free, two
 *              or more through the cache's _free_ranges: fast/frees.py), the new leaf.
 *   inc_lock / dec_lock   the lock loops.
 *   evict      the eviction loop over the lazily deleted heap; the evicted values are freed
 *              together at the end (one piece straight to free; two or more C-held values as
 *              one joined tensor through the cache's _free_joined, others through
 *              _free_values: fast/frees.py).
 *   paged_front  the pages k frees of a sorted-prepend paged allocator put in front of its
 *              free list, in one pass (fast/frees.py's PAGED batches).
 *   native frees  what evict and insert free goes straight into sglang's exact allocators on
 *              the CPU, as one free per piece would leave them (see that section); the SWA
 *              allocator's whole release in one call (swa_free).
 *   composed tree  the one-component paths of the SWA and Mamba caches (fast/one_aux.py) over
 *              the pure-Python node classes, read through their __slots__ offsets ("Python-node
 *              fields"): the locks ("composed tree: clock"), the match ("cmatch"), the insert's
 *              plan, walk, leaf and commit ("cinsert") and the evicts' loops ("cevict"), all
 *              through one set of field, record, LRU and counter helpers ("Python-node
 *              fields"); the match, the insert, the locks and the evict also for the stock
 *              SWA and Mamba plug-ins together (pair_match, pair_insert with the insert's
 *              checks in front of it, pair_insert_api, and pair_inc /
 *              pair_dec in "composed tree: pair locks": fast/hybrid.py's general path for
 *              that pair; pair_evict: fast/pair_evict.py, "pair evict"), and a Mamba state's
 *              copy from a slab (state_copy).  Each declines
 *              (returns None, nothing changed) what it does not take, and the Python
 *              function runs.
 *
 * Each function does exactly what the pure-Python method of the same name in fast/cache.py
 * does, step by step, in the same order (the Python code stays the reference and the fallback;
 * the lockstep runs and the upstream corpus replay check both).  The cache's scalar state
 * (_clock, _evictable, _protected) stays in the Python object's attributes: it is read at the
 * start of a call and written back at its end, on error paths too.  The heap stays a Python
 * list of (stamp, node) tuples with heapq's invariant, so Python code (compaction, eviction
 * order, the exhaustive checker) reads and changes it as before.
 *
 * Keys handled here are array('q') (any buffer of 8-byte signed items); EAGLE keys (lists of
 * token pairs) never reach this module: the Python wrappers keep them on the Python path.
 *
 * Only torch's Python API is used (torch.narrow_copy, torch.cat, Tensor.tolist), through the
 * callables handed to setup(): no build dependency on torch.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>
#include <limits.h>
#include <time.h>

/* A METH_FASTCALL entry's argument count: TypeError naming its signature otherwise. */
#define ARGC(n, signature)                                                                  \
    do {                                                                                    \
        if (nargs != (n)) {                                                                 \
            PyErr_SetString(PyExc_TypeError, signature);                                    \
            return NULL;                                                                    \
        }                                                                                   \
    } while (0)


/* A Python call's result that is only checked for an error: -1 when the call failed (r NULL,
 * the error set), else 0 with r released.  (Callers drop their arguments first.) */
static int
discard(PyObject *r)
{
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Module state (set once by setup())                                                          */
/* ------------------------------------------------------------------------------------------ */

static PyObject *g_narrow_copy = NULL;  /* torch.narrow_copy */
static PyObject *g_cat = NULL;          /* torch.cat */
static long long g_stride = 1LL << 20;
static long long g_next_id = 1;

static PyObject *s_root_node, *s_page_size, *s_clock, *s_heap, *s_evictable, *s_protected,
    *s_alloc, *s_free, *s_owned, *s_validate, *s_tolist, *s_update, *s_difference_update,
    *s_free_values, *s_free_joined, *s_free_ranges, *s_free_order, *s_queue, *s_numel, *s_data_ptr, *s_is_cpu, *s_ndim, *s_is_contiguous;

/* ------------------------------------------------------------------------------------------ */
/* TreeNode                                                                                    */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *children;   /* dict: child key -> TreeNode */
    PyObject *parent;     /* TreeNode or None */
    PyObject *key;        /* array('q') (EAGLE: list of pairs) */
    PyObject *value;      /* Slots (see below), another int64 tensor, or None */
    PyObject *vcache;     /* NULL, or the tensor view of a Slots value handed to Python */
    PyObject *extra_key;
    PyObject *ck;         /* the key this node is filed under in its parent's children */
    long long lock_ref;
    long long last_access_time;
    long long hit_count;
    long long dev_children;
    long long id;
} Node;

static PyTypeObject NodeType;

#define IS_NODE(o) (Py_IS_TYPE((o), &NodeType))
#define IS_NONE(o) ((o) == NULL || (o) == Py_None)

/* ---- Slots: a node's device slots as raw C memory ---------------------------------------- */
/*
 * What the C core stores as a node's value when the slots came from a plain tensor (exact
 * torch.Tensor, int64, CPU, 1-D, contiguous): the int64s inline in one small object, with no
 * torch tensor behind them.  A node's slots are only ever read by the tree (match
 * concatenates them, evict frees them, split copies them into two new ones), so most nodes
 * never need a tensor; Python reading ``node.value`` gets a tensor view of the same memory
 * (torch.frombuffer), made on the first read and kept on the node (vcache) until its value
 * changes, so an in-place write through that tensor is seen by the tree exactly as it was
 * when the value was a tensor.  A Slots object is never written by the C core after it is
 * made (a split makes two new ones), so a view handed out stays what it was, as a tensor the
 * tree replaced did.  Anything else (CUDA, another dtype or layout, a tensor set from Python)
 * stays a tensor, on the old paths.  Counted by sys.getsizeof (itemsize 8).
 */
typedef struct {
    PyObject_VAR_HEAD
    long long data[1];
} Slots;

static PyTypeObject SlotsType;

#define IS_SLOTS(o) (Py_IS_TYPE((o), &SlotsType))

/* Slots memory: small ones (under SLOTS_POOL_MIN bytes) come from CPython's object allocator;
 * larger ones come from a cache of freed blocks by size class (four classes per power of two,
 * a block at most 25% larger than asked), up to SLOTS_POOL_CAP bytes kept, the rest from and
 * back to the raw allocator.  What an evict frees is what the next inserts need (the new
 * leaves of a full pool are as long as the evicted ones), so a long leaf's slots land in
 * memory the process has already touched instead of fresh pages (measured on Mooncake: the
 * page faults of insert, see docs/PERFORMANCE.md).  The class is a function of the length,
 * so a block goes back to the list it came from; nothing else changes: the object, its
 * buffer and sys.getsizeof are as before. */
#define SLOTS_POOL_MIN ((size_t)4096)
#define SLOTS_POOL_CLASSES 128
#define SLOTS_POOL_CAP ((size_t)64 << 20)
static void *g_slots_pool[SLOTS_POOL_CLASSES];
static size_t g_slots_pool_bytes = 0;

/* The class of a block of size bytes (>= SLOTS_POOL_MIN) and that class's block size; a
 * class >= SLOTS_POOL_CLASSES is not pooled (allocated at its exact size). */
static int
slots_class(size_t size, size_t *block)
{
    int k = 63 - __builtin_clzll((unsigned long long)size);  /* 2^k <= size < 2^(k+1) */
    size_t base = (size_t)1 << k, step = base >> 2;
    size_t sub = (size - base + step - 1) / step;  /* 0..4 */
    if (sub == 4) {
        k += 1;
        sub = 0;
        base <<= 1;
    }
    int c = (k - 12) * 4 + (int)sub;
    *block = c < SLOTS_POOL_CLASSES ? base + sub * step : size;
    return c;
}

/* A new Slots of n items (uninitialised data); NULL on error. */
static Slots *
slots_alloc(Py_ssize_t n)
{
    size_t size = offsetof(Slots, data) + (size_t)n * sizeof(long long);
    if (size < SLOTS_POOL_MIN)
        return PyObject_NewVar(Slots, &SlotsType, n);
    size_t block;
    int c = slots_class(size, &block);
    void *m;
    if (c < SLOTS_POOL_CLASSES && g_slots_pool[c] != NULL) {
        m = g_slots_pool[c];
        g_slots_pool[c] = *(void **)m;
        g_slots_pool_bytes -= block;
    } else if ((m = PyMem_RawMalloc(block)) == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    return (Slots *)PyObject_InitVar((PyVarObject *)m, &SlotsType, n);
}

/* A new Slots holding a copy of p[0:n]; NULL on error. */
static PyObject *
slots_from(const long long *p, Py_ssize_t n)
{
    Slots *s = slots_alloc(n);
    if (s == NULL)
        return NULL;
    if (n)
        memcpy(s->data, p, (size_t)n * sizeof(long long));
    return (PyObject *)s;
}

static void
Slots_dealloc(PyObject *self)
{
    size_t size = offsetof(Slots, data) + (size_t)Py_SIZE(self) * sizeof(long long);
    if (size < SLOTS_POOL_MIN) {
        PyObject_Free(self);
        return;
    }
    size_t block;
    int c = slots_class(size, &block);
    if (c < SLOTS_POOL_CLASSES && g_slots_pool_bytes + block <= SLOTS_POOL_CAP) {
        *(void **)self = g_slots_pool[c];
        g_slots_pool[c] = self;
        g_slots_pool_bytes += block;
        return;
    }
    PyMem_RawFree(self);
}

static int
Slots_getbuffer(PyObject *self, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, self, ((Slots *)self)->data,
                             Py_SIZE(self) * (Py_ssize_t)sizeof(long long), 0, flags);
}

static Py_ssize_t
Slots_len(PyObject *self)
{
    return Py_SIZE(self);
}

static PyBufferProcs Slots_as_buffer = {Slots_getbuffer, NULL};
static PySequenceMethods Slots_as_sequence = {.sq_length = Slots_len};

static PyTypeObject SlotsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "uniradix.fast._core.Slots",
    .tp_doc = "A node's device slots as int64s in C memory (read node.value for a tensor).",
    .tp_basicsize = offsetof(Slots, data),
    .tp_itemsize = sizeof(long long),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = Slots_dealloc,
    .tp_as_buffer = &Slots_as_buffer,
    .tp_as_sequence = &Slots_as_sequence,
};

static PyObject *g_frombuffer = NULL;  /* torch.frombuffer (imported on first use) */
static PyObject *g_empty = NULL;       /* torch.empty */
static PyObject *g_empty_kw = NULL;    /* ("dtype",) */
static PyObject *g_Tensor, *g_int64;   /* (set by setup_api, below) */

/* torch's frombuffer, empty and int64 where setup_* has not set them; 0 or -1. */
static int
ensure_torch(void)
{
    if (g_frombuffer != NULL && g_empty != NULL && g_int64 != NULL && g_empty_kw != NULL)
        return 0;
    PyObject *torch = PyImport_ImportModule("torch");
    if (torch == NULL)
        return -1;
    int rc = -1;
    if (g_empty_kw == NULL && (g_empty_kw = Py_BuildValue("(s)", "dtype")) == NULL)
        goto done;
    if (g_frombuffer == NULL && (g_frombuffer = PyObject_GetAttrString(torch, "frombuffer")) == NULL)
        goto done;
    if (g_empty == NULL && (g_empty = PyObject_GetAttrString(torch, "empty")) == NULL)
        goto done;
    if (g_int64 == NULL && (g_int64 = PyObject_GetAttrString(torch, "int64")) == NULL)
        goto done;
    rc = 0;
done:
    Py_DECREF(torch);
    return rc;
}

static PyObject *new_int64(Py_ssize_t n, long long **data);  /* (below) */

/* The int64 tensor over a Slots' memory (a view: writes through it change the slots); new
 * reference, NULL on error. */
static PyObject *
slots_view(PyObject *s)
{
    if (ensure_torch() < 0)
        return NULL;
    if (Py_SIZE(s) == 0) {  /* frombuffer refuses an empty buffer */
        long long *unused;
        return new_int64(0, &unused);
    }
    PyObject *a[2] = {s, g_int64};
    return PyObject_Vectorcall(g_frombuffer, a, 1, g_empty_kw);
}

/* v as a tensor: a Slots' view, anything else itself; new reference. */
static PyObject *
as_tensor(PyObject *v)
{
    return IS_SLOTS(v) ? slots_view(v) : Py_NewRef(v);
}

/* Set a node's value (new reference taken on v), dropping the view of the old one. */
static void
set_value(Node *n, PyObject *v)
{
    PyObject *old = n->value, *oc = n->vcache;
    n->value = Py_NewRef(v);
    n->vcache = NULL;
    Py_XDECREF(old);
    Py_XDECREF(oc);
}

/* A new node; steals no references.  parent may be Py_None. */
static Node *
node_create(PyObject *key, PyObject *value, PyObject *parent, PyObject *extra_key,
            long long stamp, PyObject *ck)
{
    Node *n = PyObject_GC_New(Node, &NodeType);
    if (n == NULL)
        return NULL;
    n->children = PyDict_New();
    if (n->children == NULL) {
        n->parent = n->key = n->value = n->vcache = n->extra_key = n->ck = NULL;
        Py_DECREF(n);
        return NULL;
    }
    Py_INCREF(key); n->key = key;
    Py_INCREF(value); n->value = value;
    n->vcache = NULL;
    Py_INCREF(parent); n->parent = parent;
    Py_INCREF(extra_key); n->extra_key = extra_key;
    Py_INCREF(ck); n->ck = ck;
    n->lock_ref = 0;
    n->last_access_time = stamp;
    n->hit_count = 0;
    n->dev_children = 0;
    n->id = g_next_id++;
    PyObject_GC_Track((PyObject *)n);
    return n;
}

static PyObject *
Node_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"key", "value", "parent", "extra_key", "stamp", "ck", NULL};
    PyObject *key, *value, *parent, *extra_key, *ck = Py_None;
    long long stamp;
    if (type != &NodeType) {
        PyErr_SetString(PyExc_TypeError, "TreeNode cannot be subclassed");
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOL|O:TreeNode", kwlist, &key, &value,
                                     &parent, &extra_key, &stamp, &ck))
        return NULL;
    return (PyObject *)node_create(key, value, parent, extra_key, stamp, ck);
}

static int
Node_traverse(Node *self, visitproc visit, void *arg)
{
    Py_VISIT(self->children);
    Py_VISIT(self->parent);
    Py_VISIT(self->key);
    Py_VISIT(self->value);
    Py_VISIT(self->vcache);
    Py_VISIT(self->extra_key);
    Py_VISIT(self->ck);
    return 0;
}

static int
Node_clear(Node *self)
{
    Py_CLEAR(self->children);
    Py_CLEAR(self->parent);
    Py_CLEAR(self->key);
    Py_CLEAR(self->value);
    Py_CLEAR(self->vcache);
    Py_CLEAR(self->extra_key);
    Py_CLEAR(self->ck);
    return 0;
}

static void
Node_dealloc(Node *self)
{
    PyObject_GC_UnTrack(self);
    Py_TRASHCAN_BEGIN(self, Node_dealloc)
    Node_clear(self);
    PyObject_GC_Del(self);
    Py_TRASHCAN_END
}

static PyObject *
Node_richcompare(PyObject *a, PyObject *b, int op)
{
    if (op != Py_LT || !IS_NODE(a) || !IS_NODE(b))
        Py_RETURN_NOTIMPLEMENTED;
    return PyBool_FromLong(((Node *)a)->id < ((Node *)b)->id);
}

static PyObject *
Node_repr(Node *self)
{
    Py_ssize_t k = self->key ? PyObject_Length(self->key) : 0;
    if (k < 0)
        return NULL;
    return PyUnicode_FromFormat("TreeNode(id=%lld, key_len=%zd, lock_ref=%lld)", self->id, k,
                                self->lock_ref);
}

static PyObject *
Node_get_evicted(Node *self, void *closure)
{
    return PyBool_FromLong(!IS_NONE(self->parent) && IS_NONE(self->value));
}

/* node.value: a tensor or None, as ever; a Slots value is read through its view */
static PyObject *
Node_get_value(Node *self, void *closure)
{
    if (IS_NONE(self->value))
        Py_RETURN_NONE;
    if (!IS_SLOTS(self->value))
        return Py_NewRef(self->value);
    if (self->vcache == NULL && (self->vcache = slots_view(self->value)) == NULL)
        return NULL;
    return Py_NewRef(self->vcache);
}

static int
Node_set_value(Node *self, PyObject *v, void *closure)
{
    set_value(self, v == NULL ? Py_None : v);
    return 0;
}

static PyMemberDef Node_members[] = {
    {"children", T_OBJECT, offsetof(Node, children), 0, NULL},
    {"parent", T_OBJECT, offsetof(Node, parent), 0, NULL},
    {"key", T_OBJECT, offsetof(Node, key), 0, NULL},
    {"extra_key", T_OBJECT, offsetof(Node, extra_key), 0, NULL},
    {"ck", T_OBJECT, offsetof(Node, ck), 0, "the key this node is filed under in its parent"},
    {"lock_ref", T_LONGLONG, offsetof(Node, lock_ref), 0, NULL},
    {"last_access_time", T_LONGLONG, offsetof(Node, last_access_time), 0, NULL},
    {"hit_count", T_LONGLONG, offsetof(Node, hit_count), 0, NULL},
    {"dev_children", T_LONGLONG, offsetof(Node, dev_children), 0, "children holding device data"},
    {"id", T_LONGLONG, offsetof(Node, id), 0, NULL},
    {NULL}
};

static PyGetSetDef Node_getset[] = {
    {"evicted", (getter)Node_get_evicted, NULL, NULL, NULL},
    {"value", (getter)Node_get_value, (setter)Node_set_value,
     "device slots (an int64 tensor); None when evicted", NULL},
    {NULL}
};

static PyTypeObject NodeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "uniradix.fast._core.TreeNode",
    .tp_doc = "A radix tree node (the C twin of uniradix.fast.cache's pure-Python TreeNode).",
    .tp_basicsize = sizeof(Node),
    .tp_itemsize = 0,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = Node_new,
    .tp_dealloc = (destructor)Node_dealloc,
    .tp_traverse = (traverseproc)Node_traverse,
    .tp_clear = (inquiry)Node_clear,
    .tp_richcompare = Node_richcompare,
    .tp_repr = (reprfunc)Node_repr,
    .tp_members = Node_members,
    .tp_getset = Node_getset,
};

/* ------------------------------------------------------------------------------------------ */
/* Helpers                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* Replace a node's object field (new reference taken on v). */
#define SET_FIELD(field, v) do { PyObject *_old = (field); Py_INCREF(v); (field) = (v); Py_XDECREF(_old); } while (0)

/* An int64 view of a key: array('q') or any buffer of 8-byte signed integers. */
typedef struct {
    Py_buffer buf;
    const long long *p;
    Py_ssize_t n;
    int held;
} KeyView;

static int
key_view(PyObject *obj, KeyView *kv)
{
    kv->held = 0;
    if (PyObject_GetBuffer(obj, &kv->buf, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "uniradix._core: a key must be an array('q')");
        return -1;
    }
    kv->held = 1;
    const char *f = kv->buf.format;
    if (kv->buf.itemsize != 8 || f == NULL || f[1] != '\0' || (f[0] != 'q' && f[0] != 'l')) {
        PyBuffer_Release(&kv->buf);
        kv->held = 0;
        PyErr_SetString(PyExc_TypeError, "uniradix._core: a key must be an array('q')");
        return -1;
    }
    kv->p = (const long long *)kv->buf.buf;
    kv->n = kv->buf.len / 8;
    return 0;
}

static void
key_release(KeyView *kv)
{
    if (kv->held) {
        PyBuffer_Release(&kv->buf);
        kv->held = 0;
    }
}

/* The child key of the page of p[pos:] (the caller guarantees a whole page is there):
 * the bare first unit at page size 1, a tuple of the page otherwise, (extra_key, page)
 * when extra_key is not None.  New reference. */
static PyObject *
child_key(const long long *p, Py_ssize_t pos, Py_ssize_t ps, PyObject *ek)
{
    PyObject *ck;
    if (ps == 1) {
        ck = PyLong_FromLongLong(p[pos]);
    } else {
        ck = PyTuple_New(ps);
        if (ck == NULL)
            return NULL;
        for (Py_ssize_t i = 0; i < ps; i++) {
            PyObject *x = PyLong_FromLongLong(p[pos + i]);
            if (x == NULL) {
                Py_DECREF(ck);
                return NULL;
            }
            PyTuple_SET_ITEM(ck, i, x);
        }
    }
    if (ck == NULL || IS_NONE(ek))
        return ck;
    PyObject *t = PyTuple_Pack(2, ek, ck);
    Py_DECREF(ck);
    return t;
}

/* children[ck] of node (borrowed, NULL if absent, NULL with an error set on failure). */
static PyObject *
child_get(Node *node, PyObject *ck)
{
    if (!PyDict_CheckExact(node->children)) {
        PyErr_SetString(PyExc_TypeError, "TreeNode.children must be a dict");
        return NULL;
    }
    PyObject *c = PyDict_GetItemWithError(node->children, ck);
    if (c != NULL && !IS_NODE(c)) {
        PyErr_SetString(PyExc_TypeError, "a child is not a TreeNode");
        return NULL;
    }
    return c;
}

/* Whole-page length of the common prefix of a[0:na] and b[0:nb] (their first page is shared). */
static Py_ssize_t
shared_pages(const long long *a, Py_ssize_t na, const long long *b, Py_ssize_t nb, Py_ssize_t ps)
{
    Py_ssize_t m = na < nb ? na : nb, i = 0;
    while (i < m && a[i] == b[i])
        i++;
    return i - i % ps;
}


/* ---- child lookup without building the page tuple ---------------------------------------- */
/*
 * At page size > 1 a child key is a tuple of the page's token ids (namespaced as
 * (extra_key, page)); building it costs an int object per token.  A lookup instead hashes the
 * page the way CPython hashes such a tuple and probes the dict with a reusable probe object
 * that compares equal to a tuple of the same contents (exact ints, as every child key the
 * cache files is).  The module checks at import that its hash is CPython's on sample keys and
 * does not probe at all otherwise (tests/test_native_core.py compares them too); a page this
 * hash does not cover (a token outside [0, 2**61 - 1)) is looked up with the real key.  The
 * probe never escapes: the dict only compares it with its stored keys.
 */

#if PY_VERSION_HEX < 0x030D0000 && SIZEOF_VOID_P == 8
#define HAVE_PROBE 1
#define XXPRIME_1 ((Py_uhash_t)11400714785074694791ULL)
#define XXPRIME_2 ((Py_uhash_t)14029467366897019727ULL)
#define XXPRIME_5 ((Py_uhash_t)2870177450012600261ULL)
#define XXROTATE(x) ((x << 31) | (x >> 33))
#define HASH_MODULUS ((1LL << 61) - 1)

typedef struct {
    PyObject_HEAD
    const long long *p;
    Py_ssize_t ps;
    PyObject *ek;  /* borrowed; NULL when the key has no extra_key */
} Probe;

static int
page_equal(PyObject *t, const long long *p, Py_ssize_t ps)
{
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != ps)
        return 0;
    for (Py_ssize_t i = 0; i < ps; i++) {
        PyObject *x = PyTuple_GET_ITEM(t, i);
        if (!PyLong_CheckExact(x))
            return 0;
        int ovf;
        long long v = PyLong_AsLongLongAndOverflow(x, &ovf);
        if (ovf || v != p[i])
            return 0;
    }
    return 1;
}

static PyObject *
Probe_richcompare(PyObject *self, PyObject *other, int op)
{
    Probe *pr = (Probe *)self;
    if ((op != Py_EQ && op != Py_NE) || pr->p == NULL)
        Py_RETURN_NOTIMPLEMENTED;
    int eq;
    if (pr->ek == NULL) {
        eq = page_equal(other, pr->p, pr->ps);
    } else {
        eq = PyTuple_CheckExact(other) && PyTuple_GET_SIZE(other) == 2;
        if (eq) {
            int r = PyObject_RichCompareBool(PyTuple_GET_ITEM(other, 0), pr->ek, Py_EQ);
            if (r < 0)
                return NULL;
            eq = r && page_equal(PyTuple_GET_ITEM(other, 1), pr->p, pr->ps);
        }
    }
    return PyBool_FromLong(op == Py_EQ ? eq : !eq);
}

static PyTypeObject ProbeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "uniradix.fast._core._Probe",
    .tp_basicsize = sizeof(Probe),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_richcompare = Probe_richcompare,
};

static Probe *g_probe = NULL;

static Py_uhash_t
xx_lane(Py_uhash_t acc, Py_uhash_t lane)
{
    acc += lane * XXPRIME_2;
    acc = XXROTATE(acc);
    acc *= XXPRIME_1;
    return acc;
}

static Py_hash_t
xx_finish(Py_uhash_t acc, Py_ssize_t len)
{
    acc += (Py_uhash_t)len ^ (XXPRIME_5 ^ 3527539UL);
    if (acc == (Py_uhash_t)-1)
        return 1546275796;
    return (Py_hash_t)acc;
}

/* hash(child key) of p[0:ps] with extra_key ek (NULL: none) as CPython computes it; 0 when
 * not covered (a token outside [0, 2**61 - 1)), -1 on error, 1 on success. */
static int
page_hash(const long long *p, Py_ssize_t ps, PyObject *ek, Py_hash_t *out)
{
    Py_uhash_t acc = XXPRIME_5;
    for (Py_ssize_t i = 0; i < ps; i++) {
        long long v = p[i];
        if (v < 0 || v >= HASH_MODULUS)
            return 0;
        acc = xx_lane(acc, (Py_uhash_t)v);
    }
    Py_hash_t h = xx_finish(acc, ps);
    if (ek != NULL) {
        Py_hash_t he = PyObject_Hash(ek);
        if (he == -1)
            return -1;
        acc = XXPRIME_5;
        acc = xx_lane(acc, (Py_uhash_t)he);
        acc = xx_lane(acc, (Py_uhash_t)h);
        h = xx_finish(acc, 2);
    }
    *out = h;
    return 1;
}

/* children[child key of p[0:ps] with extra_key ek] through the probe: 1 looked up (*out the
 * child, borrowed, or NULL: a miss, or an error set), 0 not taken (page size 1, no probe, an
 * empty dict, a page the hash does not cover: the caller looks up with the real key), -1 on
 * error. */
static inline int
probe_get(PyObject *children, const long long *p, Py_ssize_t ps, PyObject *ek, PyObject **out)
{
    *out = NULL;
    if (ps <= 1 || g_probe == NULL || PyDict_GET_SIZE(children) == 0)
        return 0;
    Py_hash_t h;
    PyObject *e = IS_NONE(ek) ? NULL : ek;
    int r = page_hash(p, ps, e, &h);
    if (r <= 0)
        return r;
    g_probe->p = p;
    g_probe->ps = ps;
    g_probe->ek = e;
    *out = _PyDict_GetItem_KnownHash(children, (PyObject *)g_probe, h);
    g_probe->p = NULL;
    g_probe->ek = NULL;
    return 1;
}
#endif

/* children[child key of p[pos:]] of node: a borrowed child, or NULL (absent, or an error set).
 * When the real key was built for the lookup, *ck_out receives it (new reference) on a miss,
 * for the caller to file a new leaf under. */
static Node *
child_lookup(Node *node, const long long *p, Py_ssize_t pos, Py_ssize_t ps, PyObject *ek,
             PyObject **ck_out)
{
    if (ck_out != NULL)
        *ck_out = NULL;
    if (!PyDict_CheckExact(node->children)) {
        PyErr_SetString(PyExc_TypeError, "TreeNode.children must be a dict");
        return NULL;
    }
#ifdef HAVE_PROBE
    {
        PyObject *c;
        int r = probe_get(node->children, p + pos, ps, ek, &c);
        if (r < 0)
            return NULL;
        if (r > 0) {
            if (c != NULL) {
                if (!IS_NODE(c)) {
                    PyErr_SetString(PyExc_TypeError, "a child is not a TreeNode");
                    return NULL;
                }
                return (Node *)c;
            }
            if (PyErr_Occurred())
                return NULL;
            /* a miss; the caller may want the key to file a new leaf under */
            if (ck_out != NULL && (*ck_out = child_key(p, pos, ps, ek)) == NULL)
                return NULL;
            return NULL;
        }
    }
#endif
    PyObject *ck = child_key(p, pos, ps, ek);
    if (ck == NULL)
        return NULL;
    Node *c = (Node *)child_get(node, ck);
    if (c == NULL && !PyErr_Occurred() && ck_out != NULL) {
        *ck_out = ck;
        return NULL;
    }
    Py_DECREF(ck);
    return c;
}

#ifdef HAVE_PROBE
/* 1 when page_hash agrees with CPython's hash of the real keys on sample pages, else 0 */
static int
probe_self_test(void)
{
    static const long long sample[16] = {0, 1, 2, 255, 256, 1000, 65536, 1LL << 31,
                                         (1LL << 40) + 7, 5, 5, 123456789, 42, (1LL << 61) - 2,
                                         3, 99};
    PyObject *ek = PyUnicode_FromString("extra-key");
    if (ek == NULL)
        return -1;
    int same = 1;
    for (int k = 0; k < 4 && same; k++) {
        Py_ssize_t ps = k < 2 ? 16 : 2 + k;
        PyObject *e = (k % 2) ? ek : Py_None;
        PyObject *key = child_key(sample, 0, ps, e);
        if (key == NULL) {
            Py_DECREF(ek);
            return -1;
        }
        Py_hash_t want = PyObject_Hash(key), got;
        Py_DECREF(key);
        if (want == -1) {
            Py_DECREF(ek);
            return -1;
        }
        int r = page_hash(sample, ps, e == Py_None ? NULL : e, &got);
        if (r < 0) {
            Py_DECREF(ek);
            return -1;
        }
        same = r > 0 && got == want;
    }
    Py_DECREF(ek);
    return same;
}
#endif

static PyObject *
core_probing(PyObject *mod, PyObject *unused)
{
#ifdef HAVE_PROBE
    return PyBool_FromLong(g_probe != NULL);
#else
    Py_RETURN_FALSE;
#endif
}

/* token_array(list) -> array('q') of the list's ints, or None (nothing made) where any item is
 * not exactly an int (a bool, an int subclass, anything else) or lies outside int64: the
 * caller's Python conversion answers those, with its own errors (fast/radix_key.py
 * as_token_array).  One pass over the list, each int read in place, instead of array('q',
 * list) plus a second pass checking for bools. */
static PyObject *g_q_zero = NULL;  /* array('q', [0]): repeated to make the result */

static PyObject *
core_token_array(PyObject *mod, PyObject *seq)
{
    if (!PyList_CheckExact(seq))
        Py_RETURN_NONE;
    if (g_q_zero == NULL) {
        PyObject *m = PyImport_ImportModule("array");
        if (m == NULL)
            return NULL;
        g_q_zero = PyObject_CallMethod(m, "array", "s[i]", "q", 0);
        Py_DECREF(m);
        if (g_q_zero == NULL)
            return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(seq);
    PyObject *arr = PySequence_Repeat(g_q_zero, n);
    if (arr == NULL)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(arr, &view, PyBUF_WRITABLE) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    long long *out = (long long *)view.buf;
    int ok = view.itemsize == 8 && view.len == n * 8;
    for (Py_ssize_t j = 0; ok && j < n; j++) {
        PyObject *item = PyList_GET_ITEM(seq, j);  /* (borrowed; no Python code runs here) */
        if (!PyLong_CheckExact(item)) {
            ok = 0;
            break;
        }
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow)
            ok = 0;
        else
            out[j] = v;
    }
    PyBuffer_Release(&view);
    if (!ok) {
        Py_DECREF(arr);
        Py_RETURN_NONE;
    }
    return arr;
}

static PyObject *
core_page_hash(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    /* page_hash(array, extra_key or None) -> hash or None (not covered); for the tests */
    ARGC(2, "page_hash(array, extra_key)");
#ifdef HAVE_PROBE
    KeyView kv;
    if (key_view(args[0], &kv) < 0)
        return NULL;
    Py_hash_t h;
    int r = page_hash(kv.p, kv.n, IS_NONE(args[1]) ? NULL : args[1], &h);
    key_release(&kv);
    if (r < 0)
        return NULL;
    if (r > 0)
        return PyLong_FromSsize_t(h);
#endif
    Py_RETURN_NONE;
}

/* ---- the heap: a Python list of (stamp, node) tuples with heapq's invariant ---------------- */

/* The composed tree's node class and its id slot's offset (set by setup_pynode, in the
 * "Python-node fields" section below; declared here for entry_lt). */
static PyTypeObject *g_pn_type;
static Py_ssize_t PN_id;

/* a < b for heap entries; -1 on error.  Fast path for (int, node) tuples, for the C core's
 * TreeNode and for the composed tree's pure-Python Node (its id slot an exact int): stamps,
 * then ids, as the tuples' own comparison and the nodes' __lt__ order them. */
static int
entry_lt(PyObject *a, PyObject *b)
{
    if (PyTuple_CheckExact(a) && PyTuple_CheckExact(b) && PyTuple_GET_SIZE(a) == 2
            && PyTuple_GET_SIZE(b) == 2) {
        PyObject *sa = PyTuple_GET_ITEM(a, 0), *sb = PyTuple_GET_ITEM(b, 0);
        PyObject *na = PyTuple_GET_ITEM(a, 1), *nb = PyTuple_GET_ITEM(b, 1);
        int c_nodes = IS_NODE(na) && IS_NODE(nb);
        int py_nodes = !c_nodes && g_pn_type != NULL && (PyTypeObject *)Py_TYPE(na) == g_pn_type
                       && (PyTypeObject *)Py_TYPE(nb) == g_pn_type;
        if (PyLong_CheckExact(sa) && PyLong_CheckExact(sb) && (c_nodes || py_nodes)) {
            int ovf_a, ovf_b;
            long long x = PyLong_AsLongLongAndOverflow(sa, &ovf_a);
            long long y = PyLong_AsLongLongAndOverflow(sb, &ovf_b);
            if (!ovf_a && !ovf_b) {
                if (x != y)
                    return x < y;
                if (na == nb)
                    return 0;
                if (c_nodes)
                    return ((Node *)na)->id < ((Node *)nb)->id;
                PyObject *ia = *(PyObject **)((char *)na + PN_id);
                PyObject *ib = *(PyObject **)((char *)nb + PN_id);
                if (ia != NULL && ib != NULL && PyLong_CheckExact(ia) && PyLong_CheckExact(ib)) {
                    x = PyLong_AsLongLongAndOverflow(ia, &ovf_a);
                    y = PyLong_AsLongLongAndOverflow(ib, &ovf_b);
                    if (!ovf_a && !ovf_b)
                        return x < y;
                }
            }
        }
    }
    return PyObject_RichCompareBool(a, b, Py_LT);
}

/* Push entry (a new reference is taken) onto the list heap. */
static int
heap_push(PyObject *heap, PyObject *entry)
{
    if (PyList_Append(heap, entry) < 0)
        return -1;
    Py_ssize_t pos = PyList_GET_SIZE(heap) - 1;
    /* sift the new entry up towards the root */
    while (pos > 0) {
        Py_ssize_t up = (pos - 1) >> 1;
        PyObject *parent = PyList_GET_ITEM(heap, up);
        Py_INCREF(parent);
        int lt = entry_lt(entry, parent);
        Py_DECREF(parent);
        if (lt < 0)
            return -1;
        if (!lt)
            break;
        if (pos >= PyList_GET_SIZE(heap) || up >= PyList_GET_SIZE(heap)
                || PyList_GET_ITEM(heap, pos) != entry) {
            PyErr_SetString(PyExc_RuntimeError, "heap changed during a push");
            return -1;
        }
        /* swap: both items stay owned by the list */
        PyList_SET_ITEM(heap, pos, PyList_GET_ITEM(heap, up));
        PyList_SET_ITEM(heap, up, entry);
        pos = up;
    }
    return 0;
}

static int
push_stamp(PyObject *heap, long long stamp, Node *node)
{
    PyObject *s = PyLong_FromLongLong(stamp);
    if (s == NULL)
        return -1;
    PyObject *t = PyTuple_New(2);
    if (t == NULL) {
        Py_DECREF(s);
        return -1;
    }
    Py_INCREF(node);
    PyTuple_SET_ITEM(t, 0, s);
    PyTuple_SET_ITEM(t, 1, (PyObject *)node);
    int r = heap_push(heap, t);
    Py_DECREF(t);
    return r;
}

/* Pop the smallest entry (new reference); the heap must not be empty. */
static PyObject *
heap_pop(PyObject *heap)
{
    Py_ssize_t n = PyList_GET_SIZE(heap);
    PyObject *last = PyList_GET_ITEM(heap, n - 1);
    Py_INCREF(last);
    if (PyList_SetSlice(heap, n - 1, n, NULL) < 0) {
        Py_DECREF(last);
        return NULL;
    }
    n--;
    if (n == 0)
        return last;
    PyObject *top = PyList_GET_ITEM(heap, 0);  /* ownership moves to us */
    PyList_SET_ITEM(heap, 0, last);            /* the list owns `last` now */
    /* sift `last` down from the root */
    Py_ssize_t pos = 0;
    for (;;) {
        Py_ssize_t c = 2 * pos + 1;
        if (c >= n)
            break;
        if (c + 1 < n) {
            int lt = entry_lt(PyList_GET_ITEM(heap, c + 1), PyList_GET_ITEM(heap, c));
            if (lt < 0)
                goto error;
            if (lt)
                c++;
        }
        int lt = entry_lt(PyList_GET_ITEM(heap, c), last);
        if (lt < 0)
            goto error;
        if (!lt)
            break;
        if (n != PyList_GET_SIZE(heap) || PyList_GET_ITEM(heap, pos) != last) {
            PyErr_SetString(PyExc_RuntimeError, "heap changed during a pop");
            goto error;
        }
        PyList_SET_ITEM(heap, pos, PyList_GET_ITEM(heap, c));
        PyList_SET_ITEM(heap, c, last);
        pos = c;
    }
    return top;
error:
    Py_DECREF(top);
    return NULL;
}

/* Push node if it is an evictable leaf (unlocked, no device child, holds data, not the root). */
static int
push_if_leaf(PyObject *heap, Node *node)
{
    if (node->lock_ref == 0 && node->dev_children == 0 && !IS_NONE(node->value)
            && !IS_NONE(node->parent))
        return push_stamp(heap, node->last_access_time, node);
    return 0;
}

/* ---- the cache's Python attributes ------------------------------------------------------- */

static int
get_ll(PyObject *self, PyObject *name, long long *out)
{
    PyObject *v = PyObject_GetAttr(self, name);
    if (v == NULL)
        return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int
set_ll(PyObject *self, PyObject *name, long long x)
{
    PyObject *v = PyLong_FromLongLong(x);
    if (v == NULL)
        return -1;
    int r = PyObject_SetAttr(self, name, v);
    Py_DECREF(v);
    return r;
}

/* The end of a step run while an exception was set aside (PyErr_Fetch(&et, &ev, &tb)): where
 * one was, it is the one raised again (-1; the step's own error, if any, dropped); else the
 * step's result r. */
static int
keep_error(PyObject *et, PyObject *ev, PyObject *tb, int r)
{
    if (et != NULL) {
        if (r < 0)
            PyErr_Clear();
        PyErr_Restore(et, ev, tb);
        return -1;
    }
    return r;
}

/* Write scalars back, keeping a pending exception (if any) as the one that is raised. */
static int
write_back(PyObject *self, PyObject *name, long long x)
{
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    return keep_error(et, ev, tb, set_ll(self, name, x));
}

/* The cache's root node (new reference) and page size. */
static Node *
get_root(PyObject *self, Py_ssize_t ps_known, Py_ssize_t *ps)
{
    long long p = ps_known;
    if (p == 0 && get_ll(self, s_page_size, &p) < 0)
        return NULL;
    if (p < 1) {
        PyErr_SetString(PyExc_ValueError, "page_size must be >= 1");
        return NULL;
    }
    *ps = (Py_ssize_t)p;
    PyObject *root = PyObject_GetAttr(self, s_root_node);
    if (root == NULL)
        return NULL;
    if (!IS_NODE(root)) {
        Py_DECREF(root);
        PyErr_SetString(PyExc_TypeError, "root_node is not a TreeNode");
        return NULL;
    }
    return (Node *)root;
}

static PyObject *
narrow_copy(PyObject *value, Py_ssize_t start, Py_ssize_t length)
{
    if (g_narrow_copy == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "uniradix._core: setup() was not called");
        return NULL;
    }
    PyObject *args[4];
    PyObject *zero = PyLong_FromLong(0);
    PyObject *a = PyLong_FromSsize_t(start);
    PyObject *b = PyLong_FromSsize_t(length);
    PyObject *r = NULL;
    if (zero && a && b) {
        args[0] = value; args[1] = zero; args[2] = a; args[3] = b;
        r = PyObject_Vectorcall(g_narrow_copy, args, 4, NULL);
    }
    Py_XDECREF(zero);
    Py_XDECREF(a);
    Py_XDECREF(b);
    return r;
}

/* obj.method(arg) for a set update with tensor.tolist(); 0 on success. */
static int
owned_apply(PyObject *owned, PyObject *method, PyObject *tensor)
{
    PyObject *lst;
    if (IS_SLOTS(tensor)) {
        Py_ssize_t n = Py_SIZE(tensor);
        if ((lst = PyList_New(n)) == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *x = PyLong_FromLongLong(((Slots *)tensor)->data[i]);
            if (x == NULL) {
                Py_DECREF(lst);
                return -1;
            }
            PyList_SET_ITEM(lst, i, x);
        }
    } else if ((lst = PyObject_CallMethodNoArgs(tensor, s_tolist)) == NULL) {
        return -1;
    }
    PyObject *r = PyObject_CallMethodOneArg(owned, method, lst);
    Py_DECREF(lst);
    return discard(r);
}

/* ---- native frees: sglang's exact allocators on the CPU ---------------------------------- */
/*
 * What one call releases (an evict's values, an insert's duplicate ranges) goes straight into
 * the allocator's list here, in one step, where that list is known to end exactly as one
 * free() per piece leaves it (fast/frees.py has the table and the conditions; its Python code
 * is the reference and the path for everything else, any device).  Two allocators, classified
 * once per (class, class attribute free) by fast/frees.py's native_kind:
 *
 *   NK_PAGED   sglang's PagedTokenToKVPoolAllocator: the pages k frees put in front of the
 *              list (paged_front below) and the old list, written into one new tensor over
 *              recycled memory (list_int64).
 *   NK_APPEND  sglang's TokenToKVPoolAllocator (page 1): free appends to free_pages
 *              (need_sort: to release_pages).
 *   NK_SLOTS   sglang's MambaSlotAllocator: free appends to free_slots.
 *   NK_HOST    sglang's host pools (HostKVCache.free, MambaPoolHost.free): free appends to
 *              free_slots under the pool's lock, which is held here too.
 *
 *              The appending kinds give the list a tail (a list longer than 4x the new
 *              slots + 4096; a shorter one is copied with them into a new tensor of exactly
 *              their size, as free does): the list becomes a view of a buffer kept on a
 *              holder (_free_tail: the cache for its own KV allocator, otherwise one holder
 *              per allocator, fast/frees.py tail_holder) with
 *              spare room after its end, so an append writes only the new slots instead of
 *              copying the whole list each time (a free list of millions of slots is
 *              copied once per doubling).  The buffer is written only past the highest index
 *              ever written into it (_free_tail_hw), so no tensor anyone holds (a slice alloc
 *              handed out, a backup_state) ever sees a value change; the list is appended to
 *              in place only while it still ends exactly there, otherwise a new buffer is made
 *              (spare room: at most max(list, 64k) slots per holder, docs/COMPAT.md "Frees";
 *              more where the memory is a retired block that fits: see "tail buffer memory"
 *              below).  A new buffer's memory is a block no tensor holds any more when one
 *              is spare (the list of a 4M-slot pool moved into fresh memory costs ~18 ms of
 *              page faults, into a reused block ~4 ms).
 *              The holder also keeps the buffer's capacity with it (_free_tail_at), so an
 *              append reads only the buffer's data pointer through torch (tail_data); a
 *              buffer set on the holder any other way is read in full.
 *
 *   The SWA allocator (sglang's SWATokenToKVPoolAllocator) is not a kind: swa_free below
 *   releases its batches in one call through the two sub-allocators' kinds.
 *
 * Each returns 1 (done), 0 (not one of these cases: nothing changed, the caller takes the
 * Python path) or -1 (error).
 */

enum { NK_NONE = 0, NK_APPEND = 1, NK_PAGED = 2, NK_SLOTS = 3, NK_HOST = 4 };

typedef struct {
    const long long *p;
    Py_ssize_t n;
} Seg;

static PyObject *g_classify = NULL;  /* fast/frees.py native_kind(cls) -> 0, 1, 2 */
static PyObject *s_free_pages, *s_release_pages, *s_need_sort, *s_in_group, *s_debug_mode,
    *s_on_batch, *s_narrow, *s_tail, *s_tail_hw, *s_page_size_attr, *s_free_slots, *s_lock,
    *s_acquire, *s_release, *s_tail_at;
static int piece_is_plain(PyObject *t, Py_ssize_t *n);
static Py_ssize_t paged_front_into(const Seg *segs, Py_ssize_t k, long long ps, long long **out);

#define KIND_SLOTS 8
static struct { PyObject *type; PyObject *free; int kind; } g_kinds[KIND_SLOTS];
static int g_kind_next = 0;

/* obj.name where it may be missing, without raising and clearing an AttributeError (the
 * token allocator has no debug_mode: an exception made and dropped on every free): 1 found
 * (*out a new reference), 0 missing (*out NULL), -1 on error. */
static int
optional_attr(PyObject *obj, PyObject *name, PyObject **out)
{
#if PY_VERSION_HEX >= 0x030D0000
    return PyObject_GetOptionalAttr(obj, name, out);
#else
    return _PyObject_LookupAttr(obj, name, out);
#endif
}

/* The kind of alloc's class (its free looked up on the class, so a patched method is a new
 * classification); -1 on error. */
static int
alloc_kind(PyObject *alloc)
{
    PyTypeObject *tp = Py_TYPE(alloc);
    PyObject *fn = _PyType_Lookup(tp, s_free);  /* borrowed, may be NULL */
    for (int i = 0; i < KIND_SLOTS; i++)
        if (g_kinds[i].type == (PyObject *)tp && g_kinds[i].free == fn)
            return g_kinds[i].kind;
    if (g_classify == NULL)
        return NK_NONE;
    Py_XINCREF(fn);  /* keep it while Python code runs */
    PyObject *r = PyObject_CallOneArg(g_classify, (PyObject *)tp);
    if (r == NULL) {
        Py_XDECREF(fn);
        return -1;
    }
    long kind = PyLong_AsLong(r);
    Py_DECREF(r);
    if (kind == -1 && PyErr_Occurred()) {
        Py_XDECREF(fn);
        return -1;
    }
    if (kind < NK_APPEND || kind > NK_HOST)
        kind = NK_NONE;
    int i = g_kind_next;
    g_kind_next = (g_kind_next + 1) % KIND_SLOTS;
    Py_XSETREF(g_kinds[i].type, Py_NewRef((PyObject *)tp));
    Py_XSETREF(g_kinds[i].free, fn);  /* the reference taken above */
    g_kinds[i].kind = (int)kind;
    return (int)kind;
}

/* A plain tensor (exact torch.Tensor, int64, CPU, 1-D, contiguous): its data and length;
 * 1, 0 (not plain) or -1.  Five reads of torch's Python API (dtype, is_cpu, shape,
 * is_contiguous(), data_ptr()): the length comes from the shape, not a numel() call. */
static int
plain_data(PyObject *t, const long long **p, Py_ssize_t *n)
{
    int ok = piece_is_plain(t, n);
    if (ok <= 0)
        return ok;
    PyObject *o = PyObject_CallMethodNoArgs(t, s_data_ptr);
    if (o == NULL)
        return -1;
    *p = (const long long *)PyLong_AsVoidPtr(o);
    Py_DECREF(o);
    if (*p == NULL && PyErr_Occurred())
        return -1;
    return 1;
}

/* A node value's data: a Slots' own memory, or plain_data of a tensor; 1, 0 or -1. */
static int
value_data(PyObject *v, const long long **p, Py_ssize_t *n)
{
    if (IS_SLOTS(v)) {
        *p = ((Slots *)v)->data;
        *n = Py_SIZE(v);
        return 1;
    }
    return plain_data(v, p, n);
}

/* new_empty of an empty int64 CPU tensor made once (torch.empty(0, dtype=torch.int64,
 * device="cpu")): a new tensor's device and dtype are the prototype's, whatever default
 * device the process or a ``with torch.device(...)`` block sets (torch.empty would follow
 * that default, and the C code below writes through the tensor's data pointer: a CUDA or
 * meta tensor there was a crash), and one keyword argument fewer to parse (~0.25 us of
 * ~0.9 us a tensor). */
static PyObject *g_i64_new_empty = NULL;

static int
i64_proto_ready(void)
{
    if (g_i64_new_empty != NULL)
        return 0;
    if (ensure_torch() < 0)
        return -1;
    PyObject *zero = PyLong_FromLong(0), *cpu = PyUnicode_FromString("cpu"),
        *kw = Py_BuildValue("(ss)", "dtype", "device"), *proto = NULL;
    if (zero != NULL && cpu != NULL && kw != NULL) {
        PyObject *a[3] = {zero, g_int64, cpu};
        proto = PyObject_Vectorcall(g_empty, a, 1, kw);
    }
    Py_XDECREF(zero);
    Py_XDECREF(cpu);
    Py_XDECREF(kw);
    if (proto == NULL)
        return -1;
    g_i64_new_empty = PyObject_GetAttrString(proto, "new_empty");
    Py_DECREF(proto);
    return g_i64_new_empty == NULL ? -1 : 0;
}

/* A new int64 CPU tensor of n elements (i64_proto_ready) and its data; NULL on error. */
static PyObject *
new_int64(Py_ssize_t n, long long **data)
{
    if (i64_proto_ready() < 0)
        return NULL;
    PyObject *no = PyLong_FromSsize_t(n);
    if (no == NULL)
        return NULL;
    PyObject *t = PyObject_CallOneArg(g_i64_new_empty, no);
    Py_DECREF(no);
    if (t == NULL)
        return NULL;
    PyObject *o = PyObject_CallMethodNoArgs(t, s_data_ptr);
    if (o == NULL) {
        Py_DECREF(t);
        return NULL;
    }
    *data = (long long *)PyLong_AsVoidPtr(o);
    Py_DECREF(o);
    if (*data == NULL && PyErr_Occurred()) {
        Py_DECREF(t);
        return NULL;
    }
    return t;
}

static char *
copy_segs(char *dst, const Seg *segs, Py_ssize_t k)
{
    for (Py_ssize_t i = 0; i < k; i++) {
        if (segs[i].n) {
            memcpy(dst, segs[i].p, (size_t)segs[i].n * 8);
            dst += (size_t)segs[i].n * 8;
        }
    }
    return dst;
}

/* ---- tail buffer memory: recycled blocks ------------------------------------------------ */
/*
 * A tail buffer is a TailMem block (raw memory, the buffer protocol) seen as an int64 tensor
 * through torch.frombuffer, which keeps a reference to the block for as long as any tensor
 * over that memory lives (documented: "increments the reference count for the object that
 * owns the shared memory").  So TailMem_dealloc runs only once no tensor anyone holds (the
 * list, a slice alloc handed out, a backup_state's view, the holder's buffer) can see the
 * block; its memory then goes to a small process-wide spare list and the next buffer made
 * takes it instead of fresh memory.  Why: fresh memory is a page fault per 4 KiB written
 * (measured on Mooncake page 1: the buffer re-makes cost ~20 ms per 1k requests, 7.7k faults,
 * and a written MB of fresh memory costs ~0.5 ms on these machines against ~0.1 ms reused).
 * The values a reused block held are never seen: nobody holds it any more, and the new
 * buffer is written before it is read (the list and the new slots at its start, hw set to
 * their end).  Kept: at most TAIL_SPARE_MAX blocks and TAIL_SPARE_CAP bytes (the larger
 * blocks win), so the memory this costs is bounded (docs/COMPAT.md "Frees").
 */
#define TAIL_SPARE_MAX 4
#define TAIL_SPARE_CAP ((size_t)256 << 20)

typedef struct TailMem {
    PyObject_HEAD
    long long *data;
    Py_ssize_t cap;      /* items */
    Py_ssize_t touched;  /* items [0, touched) have been written (their pages are mapped) */
    struct TailMem *prev, *next;  /* the live blocks (g_tail_live), found by their data */
} TailMem;

static struct { long long *data; Py_ssize_t cap, touched; } g_tail_spare[TAIL_SPARE_MAX];

/* The live TailMem blocks, so append_tail can find a buffer's block (and how far its memory
 * has been written) from the data pointer it reads anyway: a few at a time (a buffer per
 * allocator, and retired ones until the last view over them dies). */
static TailMem *g_tail_live = NULL;

static TailMem *
tail_live_find(const long long *data)
{
    for (TailMem *m = g_tail_live; m != NULL; m = m->next)
        if (m->data == data)
            return m;
    return NULL;
}

/* Bytes held by the spare list. */
static size_t
tail_spare_bytes(void)
{
    size_t b = 0;
    for (int i = 0; i < TAIL_SPARE_MAX; i++)
        if (g_tail_spare[i].data != NULL)
            b += (size_t)g_tail_spare[i].cap * 8;
    return b;
}

/* Keep a block (data, cap) as a spare if it is among the TAIL_SPARE_MAX largest within
 * TAIL_SPARE_CAP bytes; what is not kept (it, or a smaller spare it displaces) is freed. */
static void
tail_spare_put(long long *data, Py_ssize_t cap, Py_ssize_t touched)
{
    for (;;) {
        int free_slot = -1, smallest = -1;
        for (int i = 0; i < TAIL_SPARE_MAX; i++) {
            if (g_tail_spare[i].data == NULL)
                free_slot = free_slot < 0 ? i : free_slot;
            else if (smallest < 0 || g_tail_spare[i].cap < g_tail_spare[smallest].cap)
                smallest = i;
        }
        size_t bytes = (size_t)cap * 8;
        if (bytes > TAIL_SPARE_CAP) {
            PyMem_RawFree(data);
            return;
        }
        if (free_slot >= 0 && tail_spare_bytes() + bytes <= TAIL_SPARE_CAP) {
            g_tail_spare[free_slot].data = data;
            g_tail_spare[free_slot].cap = cap;
            g_tail_spare[free_slot].touched = touched;
            return;
        }
        if (smallest < 0 || g_tail_spare[smallest].cap >= cap) {
            PyMem_RawFree(data);  /* the spares are all at least as large: keep them */
            return;
        }
        PyMem_RawFree(g_tail_spare[smallest].data);  /* displaced by the larger block */
        g_tail_spare[smallest].data = NULL;
    }
}

/* The smallest spare block of at least want items, taken off the list; NULL if none. */
static long long *
tail_spare_take(Py_ssize_t want, Py_ssize_t *cap, Py_ssize_t *touched)
{
    int best = -1;
    for (int i = 0; i < TAIL_SPARE_MAX; i++)
        if (g_tail_spare[i].data != NULL && g_tail_spare[i].cap >= want
            && (best < 0 || g_tail_spare[i].cap < g_tail_spare[best].cap))
            best = i;
    if (best < 0)
        return NULL;
    long long *d = g_tail_spare[best].data;
    *cap = g_tail_spare[best].cap;
    *touched = g_tail_spare[best].touched;
    g_tail_spare[best].data = NULL;
    return d;
}

static void
TailMem_dealloc(PyObject *self)
{
    TailMem *m = (TailMem *)self;
    if (m->prev != NULL)
        m->prev->next = m->next;
    else if (g_tail_live == m)
        g_tail_live = m->next;
    if (m->next != NULL)
        m->next->prev = m->prev;
    if (m->data != NULL)
        tail_spare_put(m->data, m->cap, m->touched);
    PyObject_Free(self);
}

static int
TailMem_getbuffer(PyObject *self, Py_buffer *view, int flags)
{
    TailMem *m = (TailMem *)self;
    return PyBuffer_FillInfo(view, self, m->data, m->cap * (Py_ssize_t)sizeof(long long), 0,
                             flags);
}

static PyBufferProcs TailMem_as_buffer = {TailMem_getbuffer, NULL};

static PyTypeObject TailMemType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "uniradix.fast._core.TailMem",
    .tp_doc = "The memory of a free-list tail buffer (seen through torch.frombuffer).",
    .tp_basicsize = sizeof(TailMem),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = TailMem_dealloc,
    .tp_as_buffer = &TailMem_as_buffer,
};

/* A new tail buffer of at least want items (> 0): an int64 tensor over a spare block when
 * one is large enough, else over fresh memory; its data and length in *data, *cap, its block
 * in *mem (alive as long as the tensor).  A new reference, NULL on error (a block taken goes
 * back to the spares with the object). */
static PyObject *
tail_buffer_new(Py_ssize_t want, long long **data, Py_ssize_t *cap, TailMem **mem)
{
    if (ensure_torch() < 0)
        return NULL;
    if ((size_t)want > PY_SSIZE_T_MAX / 8) {
        PyErr_NoMemory();
        return NULL;
    }
    TailMem *m = PyObject_New(TailMem, &TailMemType);
    if (m == NULL)
        return NULL;
    m->prev = m->next = NULL;
    m->touched = 0;
    m->data = tail_spare_take(want, &m->cap, &m->touched);
    if (m->data == NULL) {
        m->cap = want;
        if ((m->data = PyMem_RawMalloc((size_t)want * 8)) == NULL) {
            Py_DECREF(m);
            PyErr_NoMemory();
            return NULL;
        }
    }
    m->next = g_tail_live;
    if (g_tail_live != NULL)
        g_tail_live->prev = m;
    g_tail_live = m;
    PyObject *a[2] = {(PyObject *)m, g_int64};
    long long *d = m->data;
    Py_ssize_t c = m->cap;
    PyObject *t = PyObject_Vectorcall(g_frombuffer, a, 1, g_empty_kw);
    Py_DECREF(m);  /* the tensor's storage holds it now (or, on error, it is gone) */
    if (t == NULL)
        return NULL;
    *data = d;
    *cap = c;
    *mem = m;
    return t;
}

/* The spare tail blocks (tail_spares() for tests and the docs' memory figures). */
static PyObject *
core_tail_spares(PyObject *mod, PyObject *noargs)
{
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (int i = 0; i < TAIL_SPARE_MAX; i++) {
        if (g_tail_spare[i].data == NULL)
            continue;
        PyObject *n = PyLong_FromSsize_t(g_tail_spare[i].cap);
        if (n == NULL || PyList_Append(out, n) < 0) {
            Py_XDECREF(n);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(n);
    }
    return out;
}

/* The tail buffer buf's data and capacity (1), or 0 where it is not a plain tensor, -1 on
 * error.  Its capacity is cached on the holder with it (_free_tail_at: (buffer, capacity),
 * written when append_tail makes the buffer), so a buffer the holder still has from there is
 * not read through torch's API again but for its data pointer, which is read every time (a
 * view's resize_ could move the storage the buffer and its views share; the buffer itself is
 * never handed out, so its length, dtype and layout stay those it was made with).  A buffer
 * set on the holder any other way is read in full (plain_data). */
static int
tail_data(PyObject *self, PyObject *buf, const long long **bp, Py_ssize_t *cap)
{
    PyObject *at;
    if (optional_attr(self, s_tail_at, &at) < 0)
        return -1;
    if (at != NULL && PyTuple_CheckExact(at) && PyTuple_GET_SIZE(at) == 2
               && PyTuple_GET_ITEM(at, 0) == buf && PyLong_CheckExact(PyTuple_GET_ITEM(at, 1))) {
        *cap = PyLong_AsSsize_t(PyTuple_GET_ITEM(at, 1));
        Py_DECREF(at);
        if (*cap == -1 && PyErr_Occurred())
            return -1;
        PyObject *o = PyObject_CallMethodNoArgs(buf, s_data_ptr);
        if (o == NULL)
            return -1;
        *bp = (const long long *)PyLong_AsVoidPtr(o);
        Py_DECREF(o);
        return (*bp == NULL && PyErr_Occurred()) ? -1 : 1;
    }
    Py_XDECREF(at);
    return plain_data(buf, bp, cap);
}

/* Record (buf, cap) as the holder's tail buffer for tail_data; 0, or -1 on error (a holder
 * that cannot take the attribute just goes without the cache). */
static int
tail_remember(PyObject *self, PyObject *buf, Py_ssize_t cap)
{
    PyObject *c = PyLong_FromSsize_t(cap);
    if (c == NULL)
        return -1;
    PyObject *at = PyTuple_Pack(2, buf, c);
    Py_DECREF(c);
    if (at == NULL)
        return -1;
    int r = PyObject_SetAttr(self, s_tail_at, at);
    Py_DECREF(at);
    if (r < 0 && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        r = 0;
    }
    return r;
}

/* buf[start:stop] (a view, as buf.narrow(0, start, stop - start) but through torch's
 * indexing, about half the cost per call); a new reference, NULL on error. */
static PyObject *
tail_view(PyObject *buf, Py_ssize_t start, Py_ssize_t stop)
{
    PyObject *a = PyLong_FromSsize_t(start), *b = a == NULL ? NULL : PyLong_FromSsize_t(stop);
    PyObject *sl = b == NULL ? NULL : PySlice_New(a, b, NULL);
    Py_XDECREF(a);
    Py_XDECREF(b);
    if (sl == NULL)
        return NULL;
    PyObject *out = PyObject_GetItem(buf, sl);
    Py_DECREF(sl);
    return out;
}

/* 1 if tail_buffer_new(want) would take a spare block whose first used items have been
 * written before (so writing them costs no page faults). */
static int
tail_spare_warm(Py_ssize_t want, Py_ssize_t used)
{
    int best = -1;
    for (int i = 0; i < TAIL_SPARE_MAX; i++)
        if (g_tail_spare[i].data != NULL && g_tail_spare[i].cap >= want
            && (best < 0 || g_tail_spare[i].cap < g_tail_spare[best].cap))
            best = i;
    return best >= 0 && g_tail_spare[best].touched >= used;
}

/* The free list of an NK_APPEND allocator (need_sort off) with segs appended, through the
 * cache's tail buffer (see above); a new reference, NULL on error.  Three ways, the first that
 * applies:
 * - the list is still the view of the tail buffer that ends at its high-water mark and the
 *   slots fit after it: written there, the list not copied; for a short list (at most about
 *   four times the new slots) only where that memory has been written before;
 * - a short list, where a new buffer would be fresh memory: the list and the new slots in a
 *   new tensor of exactly that size, as free's own torch.cat makes, whose memory the process
 *   has used before;
 * - a new buffer (a spare block, or fresh memory) with room after the list.
 * Why: fresh memory costs a page fault per 512 slots written, more than copying a short list
 * (the first fill of a pool: evict's faults 10k -> 1.7k with the copy); memory written before
 * costs none, and on a full pool (what an evict frees is allocated again at once) the list
 * then stays the buffer's view from one free to the next, so each free writes only its own
 * slots, where the copy cost a pass over the list, a torch.empty and its malloc every time
 * (Mooncake page 1, from the second pool on: evict's median 49-62 us -> 41-44 us;
 * docs/PERFORMANCE.md). */
static PyObject *
append_tail(PyObject *self, const long long *tp, Py_ssize_t tn, const Seg *segs, Py_ssize_t k,
            Py_ssize_t total)
{
    int is_short = tn <= 4 * total + 4096;
    PyObject *buf = PyObject_GetAttr(self, s_tail);
    if (buf == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        PyErr_Clear();
    }
    long long hw = 0;
    if (buf != NULL && buf != Py_None) {
        const long long *bp;
        Py_ssize_t cap;
        int ok = tail_data(self, buf, &bp, &cap);
        if (ok < 0 || (ok && get_ll(self, s_tail_hw, &hw) < 0)) {
            Py_DECREF(buf);
            return NULL;
        }
        Py_ssize_t start = -1;
        TailMem *m = NULL;
        if (ok && hw >= 0 && hw <= cap && hw + total <= cap) {
            if (tn == 0)
                start = (Py_ssize_t)hw;  /* an empty list: the new one starts at hw */
            else if (tp >= bp && tp + tn == bp + hw)
                start = (Py_ssize_t)(tp - bp);  /* still the view that ends at hw */
            if (start >= 0 && ((m = tail_live_find(bp)) != NULL ? m->touched < hw + total
                                                                 : 0) && is_short)
                start = -1;  /* fresh memory after hw: a short list is copied (below) */
        }
        if (start >= 0) {
            copy_segs((char *)(bp + hw), segs, k);
            if (m != NULL && m->touched < hw + total)
                m->touched = (Py_ssize_t)(hw + total);
            if (set_ll(self, s_tail_hw, hw + total) < 0) {
                Py_DECREF(buf);
                return NULL;
            }
            PyObject *out = tail_view(buf, start, (Py_ssize_t)(hw + total));
            Py_DECREF(buf);
            return out;
        }
    }
    Py_XDECREF(buf);
    /* a new buffer: the list and the new slots, with room after them for as many again (at
     * least 64k slots), so the copy of the list is paid once per that many slots appended */
    Py_ssize_t used = tn + total, cap = used + (used > 65536 ? used : 65536);
    long long *dst;
    if (is_short && !tail_spare_warm(cap, used)) {
        PyObject *out = new_int64(used, &dst);  /* the short list copied */
        if (out == NULL)
            return NULL;
        if (tn)
            memcpy(dst, tp, (size_t)tn * 8);
        copy_segs((char *)(dst + tn), segs, k);
        return out;
    }
    TailMem *m;
    PyObject *nb = tail_buffer_new(cap, &dst, &cap, &m);
    if (nb == NULL)
        return NULL;
    if (tn)
        memcpy(dst, tp, (size_t)tn * 8);
    copy_segs((char *)(dst + tn), segs, k);
    if (m->touched < used)
        m->touched = used;
    if (PyObject_SetAttr(self, s_tail, nb) < 0 || set_ll(self, s_tail_hw, used) < 0
            || tail_remember(self, nb, cap) < 0) {
        Py_DECREF(nb);
        return NULL;
    }
    PyObject *out = tail_view(nb, 0, used);
    Py_DECREF(nb);
    return out;
}

/* A new int64 tensor of exactly n items (n > 0), its data in *data: the list a paged free
 * writes (free's own torch.cat makes one of that length), over recycled memory.  A spare
 * block (see "tail buffer memory") that holds n items when there is one; else a new block with
 * room for a quarter more (at least 64k items), so that the next, longer lists fit it once it
 * is spare again.  Why: the paged list is written whole by every free, and into fresh memory
 * that costs a page fault per 512 items (Mooncake page 16 with SWA: 42% of the frees' samples
 * were the kernel clearing those pages, docs/PERFORMANCE.md); the previous list's block is
 * spare as soon as nobody holds that list, so two blocks take turns.  A new reference, NULL
 * on error. */
static PyObject *
list_int64(Py_ssize_t n, long long **data)
{
    int fits = 0;
    for (int i = 0; i < TAIL_SPARE_MAX && !fits; i++)
        fits = g_tail_spare[i].data != NULL && g_tail_spare[i].cap >= n;
    Py_ssize_t cap = n + (fits ? 0 : (n / 4 > 65536 ? n / 4 : 65536));
    TailMem *m;
    PyObject *buf = tail_buffer_new(cap, data, &cap, &m);
    if (buf == NULL)
        return NULL;
    if (m->touched < n)
        m->touched = n;
    PyObject *out = tail_view(buf, 0, n);
    Py_DECREF(buf);
    return out;
}

/* The free timer (free_timer below): when on, the time spent in native_release (the writes
 * into an allocator's list that stand for its free() calls) is summed on one of two clocks,
 * the ones the bench times calls with: 1 CLOCK_MONOTONIC (time.perf_counter), 2
 * CLOCK_THREAD_CPUTIME_ID (time.thread_time). 0: off, no clock is read. */
static int g_free_clock = 0;
static double g_free_seconds = 0.0;

static double
free_clock_now(void)
{
    struct timespec ts;
    clock_gettime(g_free_clock == 2 ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int native_release_untimed(PyObject *self, PyObject *alloc, const Seg *segs,
                                  Py_ssize_t k);

/* Release segs (k pieces in free order, npieces counted for an observing wrapper) into
 * alloc as k free() calls would leave it; 1, 0 (not handled, nothing changed) or -1.  Timed
 * while the free timer is on. */
static int
native_release(PyObject *self, PyObject *alloc, const Seg *segs, Py_ssize_t k)
{
    if (!g_free_clock)
        return native_release_untimed(self, alloc, segs, k);
    double t0 = free_clock_now();
    int rc = native_release_untimed(self, alloc, segs, k);
    g_free_seconds += free_clock_now() - t0;
    return rc;
}

/* ---- a paged list's head buffer -------------------------------------------------------- */
/*
 * A paged free puts its pages in front of the list (free's torch.cat((pages, list))): a copy
 * of the whole list per call, most of a long list's frees (Mooncake page 16: the full and SWA
 * sub-allocators' lists, docs/PERFORMANCE.md).  Where the list is long, it is made a view of a
 * buffer kept on the holder (_free_head) with room before it, and a later free writes its
 * pages into that room, right before the list, and makes the list the view that starts
 * there: the list is not copied.  sglang's alloc takes pages off the front as a slice, so
 * the list keeps being a view of the buffer, and the room it leaves is used again.
 *
 * Writing before the list is safe only where no tensor anyone holds sees that memory: an
 * earlier view of the list (a backup_state, a test's copy of the attribute) may cover it.  So
 * it is done only while the buffer's storage has exactly the holders it must have: the buffer
 * itself and the list (torch's storage use count; a third holder of any kind, a view or the
 * storage itself, means the list is copied into a new buffer instead).  The list's own memory
 * is never written: a backup that holds the list itself keeps its values.  The same values in
 * the same order as free's cat, so the allocator ends exactly as sglang's own free leaves it.
 */
#define HEAD_MIN 8192  /* a list shorter than this (with the new pages) is copied as before */

static PyObject *s_free_head = NULL, *g_use_count = NULL, *s_untyped_storage, *s_cdata;

/* 1 where target (a view of buf, whose storage starts at bp) and buf are the only holders of
 * buf's storage, 0 where not (or torch cannot say), -1 on error. */
static int
head_sole_view(PyObject *target, PyObject *buf, const long long *bp)
{
    static int looked = 0;
    if (g_use_count == NULL && !looked) {  /* torch._C._storage_Use_Count, looked up once */
        looked = 1;
        PyObject *tc = PyImport_ImportModule("torch._C");
        if (tc == NULL)
            return -1;
        g_use_count = PyObject_GetAttrString(tc, "_storage_Use_Count");
        Py_DECREF(tc);
        if (g_use_count == NULL) {  /* (a torch without it: the list is copied) */
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                return -1;
            PyErr_Clear();
        }
    }
    if (g_use_count == NULL)
        return 0;
    PyObject *st = PyObject_CallMethodNoArgs(target, s_untyped_storage);
    if (st == NULL)
        return -1;
    int rc = -1;
    PyObject *o = PyObject_CallMethodNoArgs(st, s_data_ptr), *cd = NULL, *n = NULL;
    if (o == NULL)
        goto done;
    void *sp = PyLong_AsVoidPtr(o);
    if (sp == NULL && PyErr_Occurred())
        goto done;
    if (sp != (void *)bp) {
        rc = 0;
        goto done;
    }
    if ((cd = PyObject_GetAttr(st, s_cdata)) == NULL
            || (n = PyObject_CallOneArg(g_use_count, cd)) == NULL)
        goto done;
    long long uses = PyLong_AsLongLong(n);
    if (uses == -1 && PyErr_Occurred())
        goto done;
    /* the buffer, the list (when it is not the buffer itself) and st, made here */
    rc = uses == (target == buf ? 2 : 3);
done:
    Py_XDECREF(n);
    Py_XDECREF(cd);
    Py_XDECREF(o);
    Py_DECREF(st);
    return rc;
}

/* The paged list target (its data tp, tn items) with front's nf pages put before it; a new
 * reference, NULL on error.  In place in the holder's head buffer where that is safe (see
 * above); otherwise a new list: a long one in a new head buffer with room before it (as much
 * again as the list, at least 64k pages), a short one, or one whose holder keeps no head
 * buffer, in a tensor of exactly its length (list_int64). */
static PyObject *
head_prepend(PyObject *holder, PyObject *target, const long long *tp, Py_ssize_t tn,
             const long long *front, Py_ssize_t nf)
{
    PyObject *buf = NULL;
    if (holder != NULL && holder != Py_None && s_free_head != NULL) {
        if ((buf = PyObject_GetAttr(holder, s_free_head)) == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                return NULL;
            PyErr_Clear();
            holder = NULL;  /* (a holder without the slot: the list is copied) */
        }
    } else {
        holder = NULL;
    }
    if (buf != NULL && buf != Py_None && nf > 0 && tn > 0) {
        const long long *bp;
        Py_ssize_t cap;
        int ok = plain_data(buf, &bp, &cap), plain = ok > 0;
        if (ok > 0 && tp >= bp + nf && tp + tn <= bp + cap)
            ok = head_sole_view(target, buf, bp);
        else if (ok > 0)
            ok = 0;
        if (ok < 0) {
            Py_DECREF(buf);
            return NULL;
        }
        if (ok) {
            Py_ssize_t off = tp - bp;
            memcpy((long long *)bp + off - nf, front, (size_t)nf * 8);
            PyObject *out = tail_view(buf, off - nf, off + tn);
            Py_DECREF(buf);
            return out;
        }
        /* A list made elsewhere (sglang's own free cats a new one) while the buffer is held by
         * nobody but the holder: the list is copied into the buffer, at its end, where the room
         * left before it is at least a quarter of the list; no new memory is mapped for it. */
        Py_ssize_t used = nf + tn;
        if (plain && used >= HEAD_MIN
                && (tp + tn <= bp || tp >= bp + cap) && cap - used >= (used >> 2)) {
            int sole = head_sole_view(buf, buf, bp);
            if (sole < 0) {
                Py_DECREF(buf);
                return NULL;
            }
            if (sole) {
                /* The list sglang made is usually its new pages before the list this buffer
                 * held, which ended at the buffer's end as this one will: the items already
                 * there (an equal suffix, compared a chunk at a time from the end) are not
                 * written again.  Skipping a write of equal bytes is always safe. */
                Py_ssize_t off = cap - used, keep = tn;
                long long *dst = (long long *)bp + off + nf;
                while (keep > 0) {
                    Py_ssize_t c = keep < 2048 ? keep : 2048;
                    if (memcmp(dst + keep - c, tp + keep - c, (size_t)c * 8) != 0)
                        break;
                    keep -= c;
                }
                memcpy((long long *)bp + off, front, (size_t)nf * 8);
                if (keep)
                    memcpy(dst, tp, (size_t)keep * 8);
                PyObject *out = tail_view(buf, off, cap);
                Py_DECREF(buf);
                return out;
            }
        }
    }
    Py_XDECREF(buf);
    long long *dst;
    Py_ssize_t used = nf + tn;
    if (holder == NULL || used < HEAD_MIN || nf == 0) {
        PyObject *out = list_int64(used, &dst);
        if (out == NULL)
            return NULL;
        if (nf)
            memcpy(dst, front, (size_t)nf * 8);
        if (tn)
            memcpy(dst + nf, tp, (size_t)tn * 8);
        return out;
    }
    /* (a tensor of its own, not a view of a recycled block: head_sole_view counts the
     * tensors on its storage; the pages written into it are few after this one copy) */
    Py_ssize_t room = used > 65536 ? used : 65536;
    PyObject *nb = new_int64(room + used, &dst);
    if (nb == NULL)
        return NULL;
    memcpy(dst + room, front, (size_t)nf * 8);
    if (tn)
        memcpy(dst + room + nf, tp, (size_t)tn * 8);
    PyObject *out = PyObject_SetAttr(holder, s_free_head, nb) < 0 ? NULL
        : tail_view(nb, room, room + used);
    Py_DECREF(nb);
    return out;
}

static int
native_release_untimed(PyObject *self, PyObject *alloc, const Seg *segs, Py_ssize_t k)
{
    if (g_empty == NULL || g_Tensor == NULL || k == 0)
        return 0;
    int kind = alloc_kind(alloc);
    if (kind <= 0)
        return kind;
    PyObject *o;
    if (kind == NK_APPEND || kind == NK_PAGED) {  /* the KV allocators' free groups, debug */
        if ((o = PyObject_GetAttr(alloc, s_in_group)) == NULL)
            return -1;
        int outside = o == Py_True;
        Py_DECREF(o);
        if (!outside)
            return 0;  /* inside a free group free() only queues */
        int has = optional_attr(alloc, s_debug_mode, &o);
        if (has < 0)
            return -1;
        if (!has) {
            if (kind == NK_PAGED)
                return 0;  /* the paged class always has one: something else */
        } else {
            int t = PyObject_IsTrue(o);
            Py_DECREF(o);
            if (t)
                return t < 0 ? -1 : 0;  /* debug mode: its per-call checks run */
        }
    }
    /* free as the instance resolves it: the class's, or a wrapper that only observes */
    PyObject *observer = NULL;
    PyObject *fn = PyObject_GetAttr(alloc, s_free);
    if (fn == NULL)
        return -1;
    if (!(PyMethod_Check(fn) && PyMethod_GET_SELF(fn) == alloc
          && PyMethod_GET_FUNCTION(fn) == _PyType_Lookup(Py_TYPE(alloc), s_free))) {
        observer = PyObject_GetAttr(fn, s_on_batch);
        if (observer == NULL || !PyCallable_Check(observer)) {
            Py_DECREF(fn);
            if (observer == NULL && !PyErr_ExceptionMatches(PyExc_AttributeError))
                return -1;
            PyErr_Clear();
            Py_XDECREF(observer);
            return 0;
        }
    }
    Py_DECREF(fn);
    int rc = -1;
    PyObject *target = NULL, *out = NULL, *lock = NULL;
    long long *front = NULL;
    PyObject *tname = s_free_slots;
    if (kind == NK_HOST) {  /* the pool's free holds its lock (an RLock) */
        if ((lock = PyObject_GetAttr(alloc, s_lock)) == NULL)
            goto done;
        if ((o = PyObject_CallMethodNoArgs(lock, s_acquire)) == NULL) {
            Py_CLEAR(lock);
            goto done;
        }
        Py_DECREF(o);
    }
    if (kind == NK_APPEND || kind == NK_PAGED) {
        if ((o = PyObject_GetAttr(alloc, s_need_sort)) == NULL)
            goto done;
        int need_sort = PyObject_IsTrue(o);
        Py_DECREF(o);
        if (need_sort < 0)
            goto done;
        tname = need_sort ? s_release_pages : s_free_pages;
    }
    if ((target = PyObject_GetAttr(alloc, tname)) == NULL)
        goto done;
    const long long *tp;
    Py_ssize_t tn;
    int ok = plain_data(target, &tp, &tn);
    if (ok <= 0) {
        rc = ok;  /* another device, dtype or layout: the Python path */
        goto done;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < k; i++)
        total += segs[i].n;
    if (total == 0) {
        rc = 1;  /* free ignores empty pieces */
        goto done;
    }
    if (kind == NK_PAGED) {
        long long ps;
        if (get_ll(alloc, s_page_size_attr, &ps) < 0)
            goto done;
        if (ps <= 0) {
            rc = 0;
            goto done;
        }
        Py_ssize_t nf = paged_front_into(segs, k, ps, &front);
        if (nf < 0)
            goto done;
        if ((out = head_prepend(self, target, tp, tn, front, nf)) == NULL)
            goto done;
    } else if ((out = append_tail(self, tp, tn, segs, k, total)) == NULL) {
        goto done;
    }
    if (PyObject_SetAttr(alloc, tname, out) < 0)
        goto done;
    if (observer != NULL) {
        if (discard(PyObject_CallFunction(observer, "n", k)) < 0)
            goto done;
    }
    rc = 1;
done:
    if (lock != NULL) {  /* released even on error, the error kept */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject *r = PyObject_CallMethodNoArgs(lock, s_release);
        if (r == NULL) {
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(tb);
            rc = -1;
        } else {
            Py_DECREF(r);
            PyErr_Restore(et, ev, tb);
        }
        Py_DECREF(lock);
    }
    PyMem_Free(front);
    Py_XDECREF(out);
    Py_XDECREF(target);
    Py_XDECREF(observer);
    return rc;
}

/* native_release of a list of tensors (an evict's values); 0 if one is not plain. */
static int
native_release_list(PyObject *self, PyObject *alloc, PyObject *pieces)
{
    Py_ssize_t k = PyList_GET_SIZE(pieces);
    Seg small[16], *segs = k <= 16 ? small : PyMem_Malloc((size_t)k * sizeof(Seg));
    if (segs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int rc = 1;
    for (Py_ssize_t i = 0; i < k && rc == 1; i++)
        rc = value_data(PyList_GET_ITEM(pieces, i), &segs[i].p, &segs[i].n);
    if (rc == 1)
        rc = native_release(self, alloc, segs, k);
    if (segs != small)
        PyMem_Free(segs);
    return rc;
}

/* A value's plain data, read at most once per call (insert reads it for its frees, an
 * unevict and the new leaf): state -2 not read yet, then value_data's answer. */
typedef struct {
    PyObject *obj;
    const long long *p;
    Py_ssize_t n;
    int state;
} VData;

#define VDATA_INIT(v) {(v), NULL, 0, -2}

static int
vdata_get(VData *vd)
{
    if (vd->state == -2) {
        int ok = value_data(vd->obj, &vd->p, &vd->n);
        if (ok < 0)
            return -1;
        vd->state = ok;
    }
    return vd->state;
}

/* native_release of value[lo:hi] for each (lo, hi) of ranges (2k Py_ssize_t). */
static int
native_release_ranges(PyObject *self, PyObject *alloc, VData *vd, const Py_ssize_t *ranges,
                      Py_ssize_t k)
{
    int rc = vdata_get(vd);
    if (rc <= 0)
        return rc;
    const long long *vp = vd->p;
    Py_ssize_t vn = vd->n;
    Seg small[16], *segs = k <= 16 ? small : PyMem_Malloc((size_t)k * sizeof(Seg));
    if (segs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        Py_ssize_t lo = ranges[2 * i], hi = ranges[2 * i + 1];
        if (lo < 0 || hi < lo || hi > vn) {
            rc = 0;
            break;
        }
        segs[i].p = vp + lo;
        segs[i].n = hi - lo;
    }
    if (rc == 1)
        rc = native_release(self, alloc, segs, k);
    if (segs != small)
        PyMem_Free(segs);
    return rc;
}

/* swa_take(mapping, pieces) -> (tensor, lengths) or None: the SWA slots of sglang's
 * SWATokenToKVPoolAllocator.free_swa called on each piece in turn (a new int64 tensor, in
 * that order, and a list of how many each piece gave), with mapping (full_to_swa_index_mapping) zeroed at every piece's slots as
 * those calls leave it: per piece, its slots' mapped values, those > 0 kept, then the
 * piece's slots set to 0 (a slot repeated within a piece is taken each time, one repeated
 * in a later piece is 0 by then).  None, with nothing changed, where mapping or a piece is
 * not a plain CPU int64 tensor or a slot is outside [0, len(mapping)) (where torch's indexing
 * would wrap or raise: the caller runs sglang's own method). */
static PyObject *swa_take_untimed(PyObject *const *args, Py_ssize_t nargs);

/* Timed like native_release while the free timer is on (it stands for free_swa's gathers). */
static PyObject *
core_swa_take(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (!g_free_clock)
        return swa_take_untimed(args, nargs);
    double t0 = free_clock_now();
    PyObject *r = swa_take_untimed(args, nargs);
    g_free_seconds += free_clock_now() - t0;
    return r;
}

static PyObject *
swa_take_untimed(PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "swa_take(mapping, pieces: list)");
        return NULL;
    }
    const long long *mp;
    Py_ssize_t mn;
    int ok = plain_data(args[0], &mp, &mn);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *pieces = args[1];
    Py_ssize_t k = PyList_GET_SIZE(pieces), total = 0;
    Seg small[16], *segs = k <= 16 ? small : PyMem_Malloc((size_t)(k ? k : 1) * sizeof(Seg));
    if (segs == NULL)
        return PyErr_NoMemory();
    PyObject *res = NULL, *lens = NULL;
    long long *buf = NULL;
    for (Py_ssize_t i = 0; i < k; i++) {
        ok = value_data(PyList_GET_ITEM(pieces, i), &segs[i].p, &segs[i].n);
        if (ok <= 0)
            goto out;
        for (Py_ssize_t j = 0; j < segs[i].n; j++) {
            if (segs[i].p[j] < 0 || segs[i].p[j] >= mn) {
                ok = 0;
                goto out;
            }
        }
        total += segs[i].n;
    }
    if ((buf = PyMem_Malloc((size_t)(total ? total : 1) * sizeof(long long))) == NULL) {
        PyErr_NoMemory();
        ok = -1;
        goto out;
    }
    if ((lens = PyList_New(k)) == NULL) {
        ok = -1;
        goto out;
    }
    long long *map = (long long *)mp;
    Py_ssize_t used = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        const long long *p = segs[i].p;
        Py_ssize_t n = segs[i].n, was = used;
        for (Py_ssize_t j = 0; j < n; j++) {
            long long v = map[p[j]];
            if (v > 0)
                buf[used++] = v;
        }
        for (Py_ssize_t j = 0; j < n; j++)
            map[p[j]] = 0;
        PyObject *c = PyLong_FromSsize_t(used - was);
        if (c == NULL) {  /* (the mapping is written: an error past this point is fatal
                           * to the caller's state, as a MemoryError inside free would be) */
            ok = -1;
            goto out;
        }
        PyList_SET_ITEM(lens, i, c);
    }
    long long *dst;
    if ((res = new_int64(used, &dst)) == NULL) {
        ok = -1;
        goto out;
    }
    if (used)
        memcpy(dst, buf, (size_t)used * 8);
out:
    PyMem_Free(buf);
    if (segs != small)
        PyMem_Free(segs);
    if (ok <= 0) {
        Py_XDECREF(lens);
        Py_XDECREF(res);
        if (ok < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *pair = PyTuple_Pack(2, res, lens);
    Py_DECREF(res);
    Py_DECREF(lens);
    return pair;
}

/* ---- the SWA allocator's release in one call --------------------------------------------- */
/*
 * swa_free(alloc, pieces, only_swa) does all of fast/frees.py swa_release (the reference and
 * the fallback) for sglang's exact SWATokenToKVPoolAllocator in one C call, in its steps and
 * order: the full sub-allocator's write of every piece (native_release: free, not free_swa),
 * then free_swa's part for every piece in turn (the SWA slots full_to_swa_index_mapping holds
 * at the piece, those > 0 kept, the mapping zeroed there: swa_take's loop), one write of what
 * they gave into the SWA sub-allocator's list (per piece at page > 1, as paged frees),
 * free's size checks of both sub-allocators, and the observing instance method told once.
 * The pieces are read once for all of it, the taken SWA slots never become a tensor, and
 * the exactness checks are cheap: the class part (fast/frees.py swa_class_ok: the class and
 * its free / free_swa are sglang's) is cached per (class, free, free_swa), the instance part
 * (an instance free / free_swa only where it observes, outside a free group for free) is two
 * dict lookups and one attribute read.  The sub-allocators' tail buffers are their holders
 * from fast/frees.py tail_holder, found through a small table of weak references (no
 * WeakKeyDictionary lookup per call).
 *
 * Returns 1 (done), 0 (nothing changed: the Python steps run) or -1 (error).  Everything that
 * can decline (class, instance, free group, the sub-allocators' kinds, a piece or the mapping
 * that is not a plain CPU int64 tensor, a slot outside the mapping, the full side's own
 * conditions) is decided before anything is written; where the SWA side's list cannot be
 * written natively, its free runs on the taken slots as the Python steps do.
 */

static PyObject *g_swa_classify = NULL;  /* fast/frees.py swa_class_ok(cls) -> bool */
static PyObject *g_tail_holder = NULL;   /* fast/frees.py tail_holder(alloc) -> holder */
static PyObject *s_full_attn, *s_swa_attn, *s_mapping, *s_free_swa, *s_available_size,
    *s_size_attr, *s_split, *s_module_attr, *s_qualname;

#define SWA_KIND_SLOTS 4
#define SWA_PREFETCH 64  /* slots ahead that swa_free_untimed's map walk prefetches */
static struct { PyObject *type, *free, *free_swa; int ok; } g_swa_kinds[SWA_KIND_SLOTS];
static int g_swa_kind_next = 0;

/* Whether alloc's class is sglang's SWA allocator with its own free and free_swa (cached per
 * class and the two methods the class resolves; a patched method is a new classification);
 * 1, 0 or -1. */
static int
swa_class_ok(PyObject *alloc)
{
    PyTypeObject *tp = Py_TYPE(alloc);
    PyObject *f = _PyType_Lookup(tp, s_free), *fs = _PyType_Lookup(tp, s_free_swa);
    for (int i = 0; i < SWA_KIND_SLOTS; i++)
        if (g_swa_kinds[i].type == (PyObject *)tp && g_swa_kinds[i].free == f
                && g_swa_kinds[i].free_swa == fs)
            return g_swa_kinds[i].ok;
    if (g_swa_classify == NULL || f == NULL || fs == NULL)
        return 0;
    Py_INCREF(f);  /* kept while Python code runs, then by the table */
    Py_INCREF(fs);
    PyObject *r = PyObject_CallOneArg(g_swa_classify, (PyObject *)tp);
    int ok = r == NULL ? -1 : PyObject_IsTrue(r);
    Py_XDECREF(r);
    if (ok < 0) {
        Py_DECREF(f);
        Py_DECREF(fs);
        return -1;
    }
    int i = g_swa_kind_next;
    g_swa_kind_next = (g_swa_kind_next + 1) % SWA_KIND_SLOTS;
    Py_XSETREF(g_swa_kinds[i].type, Py_NewRef((PyObject *)tp));
    Py_XSETREF(g_swa_kinds[i].free, f);
    Py_XSETREF(g_swa_kinds[i].free_swa, fs);
    g_swa_kinds[i].ok = ok;
    return ok;
}

#define HOLDER_SLOTS 8
static struct { PyObject *alloc_ref, *holder_ref; } g_holders[HOLDER_SLOTS];
static int g_holder_next = 0;

/* alloc's tail holder (fast/frees.py tail_holder), a new reference; NULL on error.  The table
 * holds weak references only (an allocator or holder that dies is never kept, nor matched:
 * its reference then reads None). */
static PyObject *
holder_of(PyObject *alloc)
{
    for (int i = 0; i < HOLDER_SLOTS; i++) {
        PyObject *ar = g_holders[i].alloc_ref;
        if (ar != NULL && PyWeakref_GET_OBJECT(ar) == alloc) {
            PyObject *h = PyWeakref_GET_OBJECT(g_holders[i].holder_ref);
            if (h != Py_None)
                return Py_NewRef(h);
        }
    }
    PyObject *h = PyObject_CallOneArg(g_tail_holder, alloc);
    if (h == NULL)
        return NULL;
    PyObject *ar = PyWeakref_NewRef(alloc, NULL);
    PyObject *hr = ar == NULL ? NULL : PyWeakref_NewRef(h, NULL);
    if (hr == NULL) {  /* not weakly referenceable: no table entry, the holder still serves */
        Py_XDECREF(ar);
        if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
            Py_DECREF(h);
            return NULL;
        }
        PyErr_Clear();
        return h;
    }
    int i = g_holder_next;
    g_holder_next = (g_holder_next + 1) % HOLDER_SLOTS;
    Py_XSETREF(g_holders[i].alloc_ref, ar);
    Py_XSETREF(g_holders[i].holder_ref, hr);
    return h;
}

/* An instance method name of alloc only where it observes: 1 (none: *obs NULL; or one that
 * carries a callable uniradix_on_batch: *obs that callable, a new reference), 0 (one that
 * does not), -1 on error. */
static int
swa_observer(PyObject *dict, PyObject *name, PyObject **obs)
{
    *obs = NULL;
    PyObject *own = dict == NULL ? NULL : PyDict_GetItemWithError(dict, name);  /* borrowed */
    if (own == NULL)
        return PyErr_Occurred() ? -1 : 1;
    Py_INCREF(own);
    PyObject *o = PyObject_GetAttr(own, s_on_batch);
    Py_DECREF(own);
    if (o == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    if (!PyCallable_Check(o)) {
        Py_DECREF(o);
        return 0;
    }
    *obs = o;
    return 1;
}

static PyObject *s_shape;  /* (a tentative definition: the API section below interns it) */

#define AVAIL_SLOTS 4
static struct { PyObject *type, *fn; int ok; } g_avail[AVAIL_SLOTS];
static int g_avail_next = 0;

/* Whether sub's class (kind NK_APPEND or NK_PAGED) resolves available_size to sglang's own
 * (TokenToKVPoolAllocator's, or for the paged class the base class's), by the function's
 * module and qualified name, cached per (class, function); 1, 0 or -1. */
static int
avail_is_sglangs(PyObject *sub, int kind)
{
    PyTypeObject *tp = Py_TYPE(sub);
    PyObject *fn = _PyType_Lookup(tp, s_available_size);  /* borrowed, may be NULL */
    for (int i = 0; i < AVAIL_SLOTS; i++)
        if (g_avail[i].type == (PyObject *)tp && g_avail[i].fn == fn)
            return g_avail[i].ok;
    if (fn == NULL)
        return 0;
    Py_INCREF(fn);
    const char *want_mod = kind == NK_APPEND ? "sglang.srt.mem_cache.allocator.token"
                                             : "sglang.srt.mem_cache.allocator.base";
    const char *want_qual = kind == NK_APPEND ? "TokenToKVPoolAllocator.available_size"
                                              : "BaseTokenToKVPoolAllocator.available_size";
    int ok = 0;
    PyObject *mod = NULL, *qual = NULL;
    if (optional_attr(fn, s_module_attr, &mod) < 0 || optional_attr(fn, s_qualname, &qual) < 0) {
        ok = -1;
    } else if (mod != NULL && qual != NULL && PyUnicode_Check(mod) && PyUnicode_Check(qual)) {
        ok = PyUnicode_CompareWithASCIIString(mod, want_mod) == 0
             && PyUnicode_CompareWithASCIIString(qual, want_qual) == 0;
    }
    Py_XDECREF(mod);
    Py_XDECREF(qual);
    if (ok < 0) {
        Py_DECREF(fn);
        return -1;
    }
    int i = g_avail_next;
    g_avail_next = (g_avail_next + 1) % AVAIL_SLOTS;
    Py_XSETREF(g_avail[i].type, Py_NewRef((PyObject *)tp));
    Py_XSETREF(g_avail[i].fn, fn);  /* the reference taken above */
    g_avail[i].ok = ok;
    return ok;
}

/* len(sub.<name>) for a tensor of one or more dimensions, from its shape (torch's len() costs
 * several times a shape read); 1, 0 (not such a tensor) or -1. */
static int
list_len(PyObject *sub, PyObject *name, Py_ssize_t *n)
{
    PyObject *t = PyObject_GetAttr(sub, name);
    if (t == NULL)
        return -1;
    int ok = 0;
    if (g_Tensor != NULL && (PyObject *)Py_TYPE(t) == g_Tensor) {
        PyObject *sh = PyObject_GetAttr(t, s_shape);
        if (sh == NULL) {
            ok = -1;
        } else {
            if (PyTuple_Check(sh) && PyTuple_GET_SIZE(sh) >= 1
                    && PyLong_Check(PyTuple_GET_ITEM(sh, 0))) {
                *n = PyLong_AsSsize_t(PyTuple_GET_ITEM(sh, 0));
                ok = (*n == -1 && PyErr_Occurred()) ? -1 : 1;
            }
            Py_DECREF(sh);
        }
    }
    Py_DECREF(t);
    return ok;
}

/* sub.available_size() <= sub.size, as free asserts it; 0, or -1 with AssertionError.  Where
 * sub's available_size is sglang's own (avail_is_sglangs) it is computed here as that method
 * does, (len(free_pages) + len(release_pages)), times page_size for the paged class;
 * otherwise the method is called. */
static int
swa_size_check(PyObject *sub, int kind)
{
    PyObject *a = NULL;
    int own = avail_is_sglangs(sub, kind);
    if (own < 0)
        return -1;
    if (own) {
        Py_ssize_t nf, nr;
        long long ps = 1;
        int ok = list_len(sub, s_free_pages, &nf);
        if (ok > 0)
            ok = list_len(sub, s_release_pages, &nr);
        if (ok > 0 && kind == NK_PAGED && get_ll(sub, s_page_size_attr, &ps) < 0)
            ok = -1;
        if (ok < 0)
            return -1;
        if (ok > 0 && (a = PyLong_FromLongLong(((long long)nf + nr) * ps)) == NULL)
            return -1;
    }
    if (a == NULL && (a = PyObject_CallMethodNoArgs(sub, s_available_size)) == NULL)
        return -1;
    PyObject *n = PyObject_GetAttr(sub, s_size_attr);
    if (n == NULL) {
        Py_DECREF(a);
        return -1;
    }
    int le = PyObject_RichCompareBool(a, n, Py_LE);
    Py_DECREF(a);
    Py_DECREF(n);
    if (le < 0)
        return -1;
    if (!le) {
        PyErr_SetNone(PyExc_AssertionError);
        return -1;
    }
    return 0;
}

/* Where the SWA sub-allocator's list cannot be written natively: its own free of the taken
 * slots (one call at page 1, where it appends; at page > 1 one per piece, empty ones too), as
 * fast/frees.py swa_release does; 0 or -1. */
static int
swa_free_taken(PyObject *swa, const long long *taken, Py_ssize_t used, PyObject *lens, int paged)
{
    long long *dst;
    PyObject *t = new_int64(used, &dst);
    if (t == NULL)
        return -1;
    if (used)
        memcpy(dst, taken, (size_t)used * 8);
    PyObject *parts = paged ? PyObject_CallMethodOneArg(t, s_split, lens) : PyTuple_Pack(1, t);
    Py_DECREF(t);
    if (parts == NULL)
        return -1;
    PyObject *seq = PySequence_Fast(parts, "split");
    Py_DECREF(parts);
    if (seq == NULL)
        return -1;
    int rc = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq) && rc == 0; i++)
        rc = discard(PyObject_CallMethodOneArg(swa, s_free, PySequence_Fast_GET_ITEM(seq, i)));
    Py_DECREF(seq);
    return rc;
}

/* which: NULL (every piece freed by free, or with only_swa by free_swa), or for a batch of
 * both (fast/frees.py FreeBatch: runs of free and free_swa in free order) one byte per piece,
 * 1 where the piece is free's, 0 where it is free_swa's.  Such a batch leaves the allocator as
 * the calls in turn would: the full sub-allocator's list gets free's pieces in their order
 * (free_swa never touches it), and the SWA side is free_swa of every piece in turn (free's
 * second step), one write of what they give; free's size checks once at the end, each
 * observing instance method told the number of its pieces. */
static int
swa_free_untimed(PyObject *alloc, PyObject *pieces, int only_swa, const char *which)
{
    Py_ssize_t k = PyList_GET_SIZE(pieces);
    if (g_empty == NULL || g_Tensor == NULL || g_tail_holder == NULL || k == 0)
        return 0;
    Py_ssize_t nfree = only_swa ? 0 : k;  /* the pieces free takes (the full side's) */
    if (which != NULL) {
        nfree = 0;
        for (Py_ssize_t i = 0; i < k; i++)
            nfree += which[i] != 0;
        only_swa = nfree == 0;
    }
    int mixed = nfree > 0 && nfree < k;
    int ok = swa_class_ok(alloc);
    if (ok <= 0)
        return ok;
    /* the pieces held for the whole call (their memory is read after Python code runs: the
     * holders' lookup, an observer of the full sub-allocator) */
    PyObject *held = PyList_GetSlice(pieces, 0, k);
    if (held == NULL)
        return -1;
    pieces = held;
    int rc = -1;
    PyObject *dict = NULL, *obs = NULL, *other = NULL, *full = NULL, *swa = NULL,
        *mapping = NULL, *hf = NULL, *hs = NULL, *lens = NULL;
    Seg small[16], *segs = small, *tsegs = NULL, *fsegs = NULL;
    long long *taken = NULL;
    dict = PyObject_GenericGetDict(alloc, NULL);
    if (dict == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            goto done;
        PyErr_Clear();
    }
    /* an instance free or free_swa only where it observes; the one called is told (both,
     * for a mixed batch: obs is free's, other free_swa's) */
    if ((ok = swa_observer(dict, only_swa ? s_free : s_free_swa, &other)) <= 0
            || (ok = swa_observer(dict, only_swa ? s_free_swa : s_free, &obs)) <= 0) {
        rc = ok;
        goto done;
    }
    if (!mixed)
        Py_CLEAR(other);  /* (not called: only checked) */
    if (!only_swa) {  /* inside a free group free only queues */
        PyObject *o = PyObject_GetAttr(alloc, s_in_group);
        if (o == NULL)
            goto done;
        ok = o == Py_True;
        Py_DECREF(o);
        if (!ok) {
            rc = 0;
            goto done;
        }
    }
    if ((full = PyObject_GetAttr(alloc, s_full_attn)) == NULL
            || (swa = PyObject_GetAttr(alloc, s_swa_attn)) == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            rc = 0;
        }
        goto done;
    }
    int kind = alloc_kind(full), ks = alloc_kind(swa);
    if (kind < 0 || ks < 0)
        goto done;
    if (kind != ks || (kind != NK_APPEND && kind != NK_PAGED)) {
        rc = 0;
        goto done;
    }
    if (k > 16 && (segs = PyMem_Malloc((size_t)k * sizeof(Seg))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        if ((ok = value_data(PyList_GET_ITEM(pieces, i), &segs[i].p, &segs[i].n)) <= 0) {
            rc = ok;
            goto done;
        }
        total += segs[i].n;
    }
    if ((mapping = PyObject_GetAttr(alloc, s_mapping)) == NULL)
        goto done;
    const long long *mp;
    Py_ssize_t mn;
    if ((ok = plain_data(mapping, &mp, &mn)) <= 0) {
        rc = ok;
        goto done;
    }
    for (Py_ssize_t i = 0; i < k; i++) {  /* where torch's indexing would wrap or raise */
        for (Py_ssize_t j = 0; j < segs[i].n; j++) {
            if (segs[i].p[j] < 0 || segs[i].p[j] >= mn) {
                rc = 0;
                goto done;
            }
        }
    }
    if ((hf = holder_of(full)) == NULL || (hs = holder_of(swa)) == NULL)
        goto done;
    if (!only_swa) {  /* the full side: free's pieces, one write (nothing written when 0) */
        const Seg *fs = segs;
        if (mixed) {
            if ((fsegs = PyMem_Malloc((size_t)nfree * sizeof(Seg))) == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            for (Py_ssize_t i = 0, f = 0; i < k; i++)
                if (which[i])
                    fsegs[f++] = segs[i];
            fs = fsegs;
        }
        if ((ok = native_release_untimed(hf, full, fs, nfree)) <= 0) {
            rc = ok;
            goto done;
        }
    }
    /* from here on the state is written: an error is as one inside sglang's free */
    if ((taken = PyMem_Malloc((size_t)(total ? total : 1) * sizeof(long long))) == NULL
            || (tsegs = PyMem_Malloc((size_t)k * sizeof(Seg))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    long long *map = (long long *)mp;
    Py_ssize_t used = 0;
    for (Py_ssize_t i = 0; i < k; i++) {  /* free_swa of each piece in turn */
        const long long *p = segs[i].p;
        Py_ssize_t n = segs[i].n, was = used;
        for (Py_ssize_t j = 0; j < n; j++) {
            if (j + SWA_PREFETCH < n)  /* the map's lines a few pages on, read ahead: each
                                        * page's slots sit elsewhere in a large table */
                __builtin_prefetch(&map[p[j + SWA_PREFETCH]], 1, 1);
            long long v = map[p[j]];
            if (v > 0)
                taken[used++] = v;
        }
        for (Py_ssize_t j = 0; j < n; j++)
            map[p[j]] = 0;
        tsegs[i].p = taken + was;
        tsegs[i].n = used - was;
    }
    if (used) {
        Seg whole = {taken, used};
        int paged = kind == NK_PAGED;
        if ((ok = native_release_untimed(hs, swa, paged ? tsegs : &whole, paged ? k : 1)) < 0)
            goto done;
        if (ok == 0) {
            if (paged) {
                if ((lens = PyList_New(k)) == NULL)
                    goto done;
                for (Py_ssize_t i = 0; i < k; i++) {
                    PyObject *c = PyLong_FromSsize_t(tsegs[i].n);
                    if (c == NULL)
                        goto done;
                    PyList_SET_ITEM(lens, i, c);
                }
            }
            if (swa_free_taken(swa, taken, used, lens, paged) < 0)
                goto done;
        }
    }
    if (!only_swa && (swa_size_check(full, kind) < 0 || swa_size_check(swa, kind) < 0))
        goto done;
    if (obs != NULL && discard(PyObject_CallFunction(obs, "n", mixed ? nfree : k)) < 0)
        goto done;
    if (other != NULL && discard(PyObject_CallFunction(other, "n", k - nfree)) < 0)
        goto done;
    rc = 1;
done:
    if (segs != small)
        PyMem_Free(segs);
    PyMem_Free(fsegs);
    PyMem_Free(tsegs);
    PyMem_Free(taken);
    Py_XDECREF(lens);
    Py_XDECREF(hs);
    Py_XDECREF(hf);
    Py_XDECREF(mapping);
    Py_XDECREF(swa);
    Py_XDECREF(full);
    Py_XDECREF(obs);
    Py_XDECREF(other);
    Py_XDECREF(dict);
    Py_DECREF(held);
    return rc;
}

/* swa_free(alloc, pieces: list, only_swa) -> bool (see above); timed as a whole while the free
 * timer is on (it stands for the frees of both sub-allocators and free_swa's gathers).
 * only_swa may be a bytes object of one byte per piece instead: a mixed batch (which, above). */
static PyObject *
core_swa_free(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "swa_free(alloc, pieces: list, only_swa)");
        return NULL;
    }
    const char *which = NULL;
    int only_swa = 0;
    if (PyBytes_CheckExact(args[2])) {
        if (PyBytes_GET_SIZE(args[2]) != PyList_GET_SIZE(args[1])) {
            PyErr_SetString(PyExc_ValueError, "swa_free: one byte per piece");
            return NULL;
        }
        which = PyBytes_AS_STRING(args[2]);
    } else if ((only_swa = PyObject_IsTrue(args[2])) < 0) {
        return NULL;
    }
    double t0 = g_free_clock ? free_clock_now() : 0.0;
    int r = swa_free_untimed(args[0], args[1], only_swa, which);
    if (g_free_clock)
        g_free_seconds += free_clock_now() - t0;
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}

/* native_release(None, alloc, pieces): the holder is alloc's own, found through holder_of's
 * table (no WeakKeyDictionary lookup per call), and only where alloc is of a native kind (no
 * holder is made for another allocator); False where setup_swa_frees has not run. */
static PyObject *
core_native_release_own(PyObject *alloc, PyObject *pieces)
{
    if (g_tail_holder == NULL)
        Py_RETURN_FALSE;
    int kind = alloc_kind(alloc);
    if (kind <= 0)
        return kind < 0 ? NULL : Py_NewRef(Py_False);
    PyObject *h = holder_of(alloc);
    if (h == NULL)
        return NULL;
    int r = native_release_list(h, alloc, pieces);
    Py_DECREF(h);
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}

/* setup_swa_frees(swa_class_ok, tail_holder): the SWA allocator's release in one call. */
static PyObject *
core_setup_swa_frees(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyCallable_Check(args[0]) || !PyCallable_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "setup_swa_frees(swa_class_ok, tail_holder)");
        return NULL;
    }
    Py_XSETREF(g_swa_classify, Py_NewRef(args[0]));
    Py_XSETREF(g_tail_holder, Py_NewRef(args[1]));
    for (int i = 0; i < SWA_KIND_SLOTS; i++) {  /* classify again with the new function */
        Py_CLEAR(g_swa_kinds[i].type);
        Py_CLEAR(g_swa_kinds[i].free);
        Py_CLEAR(g_swa_kinds[i].free_swa);
    }
    for (int i = 0; i < AVAIL_SLOTS; i++) {
        Py_CLEAR(g_avail[i].type);
        Py_CLEAR(g_avail[i].fn);
    }
    for (int i = 0; i < HOLDER_SLOTS; i++) {
        Py_CLEAR(g_holders[i].alloc_ref);
        Py_CLEAR(g_holders[i].holder_ref);
    }
    Py_RETURN_NONE;
}

/* ---- split ------------------------------------------------------------------------------- */

/* value[start:start + length] as a node's new value: a Slots when value is a Slots or a plain
 * tensor, otherwise (another device, dtype or layout) torch.narrow_copy as before; new
 * reference, NULL on error. */
static PyObject *
vdata_slice(VData *vd, Py_ssize_t start, Py_ssize_t length)
{
    int ok = vdata_get(vd);
    if (ok < 0)
        return NULL;
    if (ok && start >= 0 && length >= 0 && start + length <= vd->n)
        return slots_from(vd->p + start, length);
    return narrow_copy(vd->obj, start, length);
}

static PyObject *
value_slice(PyObject *value, Py_ssize_t start, Py_ssize_t length)
{
    VData vd = VDATA_INIT(value);
    return vdata_slice(&vd, start, length);
}

/* Cut child after split_len units (0 < split_len < len(child.key)); the new upper node takes
 * its place.  Advances *clock as _split does (one step for the upper node, one for touching
 * the child).  Returns a new reference to the upper node. */
static Node *
split(Node *child, Py_ssize_t split_len, long long *clock, PyObject *heap, Py_ssize_t ps)
{
    if (!IS_NODE(child->parent)) {
        PyErr_SetString(PyExc_TypeError, "split: the node has no parent");
        return NULL;
    }
    Node *parent = (Node *)child->parent;
    PyObject *ek = child->extra_key ? child->extra_key : Py_None;
    PyObject *ckey = child->key;
    PyObject *value = child->value ? child->value : Py_None;
    Py_INCREF(parent);
    Py_INCREF(ek);
    Py_INCREF(ckey);
    Py_INCREF(value);
    Node *upper = NULL;
    PyObject *upper_key = NULL, *upper_value = NULL, *lower_key = NULL, *lower_value = NULL,
             *new_ck = NULL;
    Py_ssize_t klen = PyObject_Length(ckey);
    if (klen < 0)
        goto error;
    *clock += g_stride;
    upper_key = PySequence_GetSlice(ckey, 0, split_len);
    if (upper_key == NULL)
        goto error;
    if (value == Py_None) {
        upper_value = Py_None;
        Py_INCREF(upper_value);
    } else if ((upper_value = value_slice(value, 0, split_len)) == NULL) {
        goto error;
    }
    upper = node_create(upper_key, upper_value, (PyObject *)parent, ek, *clock,
                        child->ck ? child->ck : Py_None);
    if (upper == NULL)
        goto error;
    upper->lock_ref = child->lock_ref;
    if (PyDict_SetItem(parent->children, upper->ck, (PyObject *)upper) < 0)
        goto error;
    lower_key = PySequence_GetSlice(ckey, split_len, klen);
    if (lower_key == NULL)
        goto error;
    if (value != Py_None) {
        lower_value = value_slice(value, split_len, klen - split_len);
        if (lower_value == NULL)
            goto error;
    }
    /* from here on nothing can fail before the tree is consistent again, except the child
     * key and the dict insert (memory errors) */
    SET_FIELD(child->key, lower_key);
    if (lower_value != NULL) {
        set_value(child, lower_value);
        upper->dev_children = 1;
    }
    SET_FIELD(child->parent, (PyObject *)upper);
    {
        KeyView kv;
        if (key_view(child->key, &kv) < 0)
            goto error;
        new_ck = child_key(kv.p, 0, ps, ek);
        key_release(&kv);
        if (new_ck == NULL)
            goto error;
    }
    SET_FIELD(child->ck, new_ck);
    if (PyDict_SetItem(upper->children, new_ck, (PyObject *)child) < 0)
        goto error;
    *clock += g_stride;
    child->last_access_time = *clock;
    if (push_if_leaf(heap, child) < 0)
        goto error;
    Py_DECREF(parent); Py_DECREF(ek); Py_DECREF(ckey); Py_DECREF(value);
    Py_DECREF(upper_key); Py_DECREF(upper_value); Py_DECREF(lower_key);
    Py_XDECREF(lower_value); Py_DECREF(new_ck);
    return upper;
error:
    Py_DECREF(parent); Py_DECREF(ek); Py_DECREF(ckey); Py_DECREF(value);
    Py_XDECREF(upper_key); Py_XDECREF(upper_value); Py_XDECREF(lower_key);
    Py_XDECREF(lower_value); Py_XDECREF(new_ck);
    Py_XDECREF(upper);
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* match(cache, units, extra_key) -> (indices or None, node)                                   */
/* ------------------------------------------------------------------------------------------ */

/* The matched nodes' values (two or more) as one new int64 tensor: one torch.empty and a
 * memcpy per node when every value is a Slots or a plain tensor, otherwise torch.cat of them
 * as tensors (another device: as before).  (One node hands out its own value: core_match.) */
static PyObject *
concat_values(PyObject *chunks, PyObject *first)
{
    Py_ssize_t k = chunks != NULL ? PyList_GET_SIZE(chunks) : 1;
    PyObject *const *items = chunks != NULL ? &PyList_GET_ITEM(chunks, 0) : &first;
    Seg small[16], *segs = k <= 16 ? small : PyMem_Malloc((size_t)k * sizeof(Seg));
    if (segs == NULL)
        return PyErr_NoMemory();
    PyObject *out = NULL;
    int ok = 1;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < k && ok == 1; i++) {
        ok = value_data(items[i], &segs[i].p, &segs[i].n);
        total += ok == 1 ? segs[i].n : 0;
    }
    if (ok < 0)
        goto done;
    if (ok == 1) {
        long long *dst;
        if (ensure_torch() < 0 || (out = new_int64(total, &dst)) == NULL)
            goto done;
        copy_segs((char *)dst, segs, k);
        goto done;
    }
    if (g_cat == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "uniradix._core: setup() was not called");
        goto done;
    }
    PyObject *list = PyList_New(k);
    if (list == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *t = as_tensor(items[i]);
        if (t == NULL) {
            Py_DECREF(list);
            goto done;
        }
        PyList_SET_ITEM(list, i, t);
    }
    PyObject *a[1] = {list};
    out = PyObject_Vectorcall(g_cat, a, 1, NULL);
    Py_DECREF(list);
done:
    if (segs != small)
        PyMem_Free(segs);
    return out;
}

static PyObject *match_impl(PyObject *self, PyObject *units, PyObject *ek, Py_ssize_t ps_known);

static PyObject *
core_match(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(3, "match(cache, units, extra_key)");
    return match_impl(args[0], args[1], args[2], 0);
}

/* The match; ps_known: the page size api_match read (0: read it here). */
static PyObject *
match_impl(PyObject *self, PyObject *units, PyObject *ek, Py_ssize_t ps_known)
{
    Py_ssize_t ps;
    long long clock;
    KeyView uk, ck_view;
    uk.held = ck_view.held = 0;
    PyObject *heap = NULL, *chunks = NULL, *result = NULL;
    PyObject *first = NULL;  /* the single chunk, kept apart to avoid a list for one node */
    Node *node = NULL;
    Node *root = get_root(self, ps_known, &ps);
    if (root == NULL)
        return NULL;
    if (get_ll(self, s_clock, &clock) < 0) {
        Py_DECREF(root);
        return NULL;
    }
    long long clock0 = clock;
    heap = PyObject_GetAttr(self, s_heap);
    if (heap == NULL)
        goto done;
    if (!PyList_CheckExact(heap)) {
        PyErr_SetString(PyExc_TypeError, "_heap must be a list");
        goto done;
    }
    if (key_view(units, &uk) < 0)
        goto done;
    Py_ssize_t n = uk.n - uk.n % ps;
    const long long *u = uk.p;
    node = root;
    Py_INCREF(node);
    Py_ssize_t pos = 0;
    while (pos < n) {
        Node *child = child_lookup(node, u, pos, ps, ek, NULL);
        if (child == NULL) {
            if (PyErr_Occurred())
                goto done;
            break;
        }
        if (IS_NONE(child->value))
            break;
        Py_INCREF(child);
        if (key_view(child->key, &ck_view) < 0) {
            Py_DECREF(child);
            goto done;
        }
        Py_ssize_t klen = ck_view.n, end = pos + klen;
        if (end <= n && memcmp(ck_view.p, u + pos, (size_t)klen * 8) == 0) {
            key_release(&ck_view);
            PyObject *v = child->value;
            if (first == NULL && chunks == NULL) {
                first = v;
                Py_INCREF(first);
            } else {
                if (chunks == NULL) {
                    chunks = PyList_New(1);
                    if (chunks == NULL) {
                        Py_DECREF(child);
                        goto done;
                    }
                    PyList_SET_ITEM(chunks, 0, first);
                    first = NULL;
                }
                if (PyList_Append(chunks, v) < 0) {
                    Py_DECREF(child);
                    goto done;
                }
            }
            Py_DECREF(node);
            node = child;
            pos = end;
            continue;
        }
        Py_ssize_t shared = shared_pages(ck_view.p, klen, u + pos, n - pos, ps);
        key_release(&ck_view);
        Node *upper = split(child, shared, &clock, heap, ps);
        Py_DECREF(child);
        if (upper == NULL)
            goto done;
        Py_DECREF(node);
        node = upper;
        PyObject *v = node->value;
        if (first == NULL && chunks == NULL) {
            first = v;
            Py_INCREF(first);
        } else {
            if (chunks == NULL) {
                chunks = PyList_New(1);
                if (chunks == NULL)
                    goto done;
                PyList_SET_ITEM(chunks, 0, first);
                first = NULL;
            }
            if (PyList_Append(chunks, v) < 0)
                goto done;
        }
        break;
    }
    /* Stamp the path: the matched node newest, each ancestor one step older. */
    clock += g_stride;
    {
        long long c = clock;
        Node *cur = node;
        while (cur != NULL) {
            cur->last_access_time = c--;
            if (IS_NONE(cur->parent))
                break;
            if (!IS_NODE(cur->parent)) {
                PyErr_SetString(PyExc_TypeError, "a parent is not a TreeNode");
                goto done;
            }
            cur = (Node *)cur->parent;
        }
    }
    if (node->lock_ref == 0 && node->dev_children == 0 && node != root) {
        if (push_stamp(heap, node->last_access_time, node) < 0)
            goto done;
    }
    PyObject *indices;
    if (chunks != NULL) {
        if ((indices = concat_values(chunks, NULL)) == NULL)
            goto done;
    } else if (first != NULL && IS_SLOTS(first)) {
        /* one node: its own slots, as its tensor was before (node is that node) */
        if ((indices = Node_get_value(node, NULL)) == NULL)
            goto done;
    } else if (first != NULL) {
        indices = first;  /* ownership moves */
        first = NULL;
    } else {
        indices = Py_None;
        Py_INCREF(indices);
    }
    result = PyTuple_New(2);
    if (result == NULL) {
        Py_DECREF(indices);
        goto done;
    }
    PyTuple_SET_ITEM(result, 0, indices);
    Py_INCREF(node);
    PyTuple_SET_ITEM(result, 1, (PyObject *)node);
done:
    key_release(&ck_view);
    key_release(&uk);
    if (clock != clock0 && write_back(self, s_clock, clock) < 0)
        Py_CLEAR(result);
    Py_XDECREF(first);
    Py_XDECREF(chunks);
    Py_XDECREF(node);
    Py_XDECREF(heap);
    Py_DECREF(root);
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* insert(cache, units, extra_key, value, prev) -> prefix_len                                  */
/* ------------------------------------------------------------------------------------------ */

static int
free_slice(PyObject *free_fn, PyObject *value, Py_ssize_t lo, Py_ssize_t hi)
{
    PyObject *sl, *a, *b, *part;
    a = PyLong_FromSsize_t(lo);
    b = PyLong_FromSsize_t(hi);
    if (a == NULL || b == NULL) {
        Py_XDECREF(a);
        Py_XDECREF(b);
        return -1;
    }
    sl = PySlice_New(a, b, NULL);
    Py_DECREF(a);
    Py_DECREF(b);
    if (sl == NULL)
        return -1;
    part = PyObject_GetItem(value, sl);
    Py_DECREF(sl);
    if (part == NULL)
        return -1;
    PyObject *r = PyObject_CallOneArg(free_fn, part);
    Py_DECREF(part);
    return discard(r);
}

static int
append_ssize(PyObject *list, Py_ssize_t v)
{
    PyObject *o = PyLong_FromSsize_t(v);
    if (o == NULL)
        return -1;
    int r = PyList_Append(list, o);
    Py_DECREF(o);
    return r;
}

/* The insert; vd: the value's data (already read by api_insert, or to be read at most once
 * here); ps_known: the page size api_insert read (0: read it here). */
static PyObject *
insert_impl(PyObject *self, PyObject *units, PyObject *ek, PyObject *value, Py_ssize_t prev,
            VData *vd, Py_ssize_t ps_known);

static PyObject *
core_insert(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(5, "insert(cache, units, extra_key, value, prev)");
    Py_ssize_t prev = PyLong_AsSsize_t(args[4]);
    if (prev == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return NULL;
        PyErr_Clear();  /* a huge prev_prefix_len: nothing is a duplicate */
        prev = PY_SSIZE_T_MAX;
    }
    VData vd = VDATA_INIT(args[3]);
    return insert_impl(args[0], args[1], args[2], args[3], prev, &vd, 0);
}

static PyObject *
insert_impl(PyObject *self, PyObject *units, PyObject *ek, PyObject *value, Py_ssize_t prev,
            VData *vdp, Py_ssize_t ps_known)
{
#define vd (*vdp)
    Py_ssize_t ps;
    long long clock, evictable, protected_;
    KeyView uk, ck_view;
    uk.held = ck_view.held = 0;
    PyObject *heap = NULL, *alloc = NULL, *free_fn = NULL, *owned = NULL, *result = NULL;
    PyObject *leaf_ck = NULL, *bounds = NULL;  /* bounds: [lo0, hi0, lo1, hi1, ...] */
    Node *node = NULL, *child = NULL;
    int wrote_clock = 0;
    Node *root = get_root(self, ps_known, &ps);
    if (root == NULL)
        return NULL;
    if (get_ll(self, s_clock, &clock) < 0 || get_ll(self, s_evictable, &evictable) < 0
            || get_ll(self, s_protected, &protected_) < 0) {
        Py_DECREF(root);
        return NULL;
    }
    long long ev0 = evictable, pr0 = protected_;
    heap = PyObject_GetAttr(self, s_heap);
    if (heap == NULL)
        goto done;
    if (!PyList_CheckExact(heap)) {
        PyErr_SetString(PyExc_TypeError, "_heap must be a list");
        goto done;
    }
    {
        PyObject *validate = PyObject_GetAttr(self, s_validate);
        if (validate == NULL)
            goto done;
        int v = PyObject_IsTrue(validate);
        Py_DECREF(validate);
        if (v < 0)
            goto done;
        if (v && (owned = PyObject_GetAttr(self, s_owned)) == NULL)
            goto done;
    }
    if (key_view(units, &uk) < 0)
        goto done;
    Py_ssize_t n = uk.n - uk.n % ps;
    const long long *u = uk.p;

    wrote_clock = 1;  /* from here on the clock moves */
    clock += g_stride;
    node = root;
    Py_INCREF(node);
    node->last_access_time = clock;
    Py_ssize_t pos = 0, free_lo = -1, free_hi = -1;
    while (pos < n) {
        child = child_lookup(node, u, pos, ps, ek, &leaf_ck);
        if (child == NULL) {
            if (PyErr_Occurred())
                goto done;
            break;  /* leaf_ck: the key the new leaf is filed under */
        }
        Py_INCREF(child);
        if (key_view(child->key, &ck_view) < 0)
            goto done;
        Py_ssize_t klen = ck_view.n, end = pos + klen, shared;
        int whole = end <= n && memcmp(ck_view.p, u + pos, (size_t)klen * 8) == 0;
        shared = whole ? klen : shared_pages(ck_view.p, klen, u + pos, n - pos, ps);
        key_release(&ck_view);
        clock += g_stride;
        child->last_access_time = clock;
        if (child->lock_ref == 0 && child->dev_children == 0 && !IS_NONE(child->value)) {
            if (push_stamp(heap, clock, child) < 0)
                goto done;
        }
        if (shared < klen) {
            Node *upper = split(child, shared, &clock, heap, ps);
            if (upper == NULL)
                goto done;
            Py_DECREF(child);
            child = upper;
        }
        end = pos + shared;
        if (IS_NONE(child->value)) {
            /* unevict: the node holds device data again, the fresh slots (copied) */
            PyObject *nv = vdata_slice(&vd, pos, shared);
            if (nv == NULL)
                goto done;
            set_value(child, nv);
            Py_DECREF(nv);
            if (!IS_NODE(child->parent)) {
                PyErr_SetString(PyExc_TypeError, "a parent is not a TreeNode");
                goto done;
            }
            ((Node *)child->parent)->dev_children += 1;
            if (child->lock_ref == 0)
                evictable += shared;
            else
                protected_ += shared;
            if (owned != NULL && owned_apply(owned, s_update, child->value) < 0)
                goto done;
            if (push_if_leaf(heap, child) < 0)
                goto done;
        } else if (prev < end) {
            /* this node's duplicate range; the first is kept in free_lo/free_hi, from the
             * second on all of them go to the bounds list */
            Py_ssize_t lo = prev > pos ? prev : pos;
            if (free_lo < 0) {
                free_lo = lo;
                free_hi = end;
            } else {
                if (bounds == NULL && (bounds = Py_BuildValue("[nn]", free_lo, free_hi)) == NULL)
                    goto done;
                if (append_ssize(bounds, lo) < 0 || append_ssize(bounds, end) < 0)
                    goto done;
            }
        }
        Py_DECREF(node);
        node = child;
        child = NULL;
        pos = end;
        if (!whole)
            break;
    }
    if (free_lo >= 0) {  /* sglang's exact allocators on the CPU: straight into the list */
        int native;
        if ((alloc = PyObject_GetAttr(self, s_alloc)) == NULL)
            goto done;
        if (bounds == NULL) {
            Py_ssize_t one[2] = {free_lo, free_hi};
            native = native_release_ranges(self, alloc, &vd, one, 1);
        } else {
            Py_ssize_t nb = PyList_GET_SIZE(bounds);
            Py_ssize_t *r = PyMem_Malloc((size_t)nb * sizeof(Py_ssize_t));
            if (r == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            for (Py_ssize_t i = 0; i < nb; i++)
                r[i] = PyLong_AsSsize_t(PyList_GET_ITEM(bounds, i));
            native = native_release_ranges(self, alloc, &vd, r, nb / 2);
            PyMem_Free(r);
        }
        if (native < 0)
            goto done;
        if (native == 1) {  /* done */
            free_lo = -1;
            Py_CLEAR(bounds);
        }
    }
    /* one range left (any page size): the allocator's own free of it, which is exactly what
     * one free per node does; two or more: _free_ranges batches them (fast/frees.py) */
    if (bounds != NULL) {
        if (discard(PyObject_CallMethodObjArgs(self, s_free_ranges, value, bounds, NULL)) < 0)
            goto done;
    } else if (free_lo >= 0) {
        if ((free_fn = PyObject_GetAttr(alloc, s_free)) == NULL)
            goto done;
        if (free_slice(free_fn, value, free_lo, free_hi) < 0)
            goto done;
    }
    if (bounds != NULL || free_lo >= 0)
        vd.state = -2;  /* an allocator's Python free ran: read the value again for the leaf */
    if (pos < n) {
        clock += g_stride;
        PyObject *rest = PySequence_GetSlice(units, pos, n);
        if (rest == NULL)
            goto done;
        PyObject *ck = leaf_ck;
        leaf_ck = NULL;
        if (ck == NULL && (ck = child_key(u, pos, ps, ek)) == NULL) {
            Py_DECREF(rest);
            goto done;
        }
        PyObject *lv = vdata_slice(&vd, pos, n - pos);
        if (lv == NULL) {
            Py_DECREF(rest);
            Py_DECREF(ck);
            goto done;
        }
        Node *leaf = node_create(rest, lv, (PyObject *)node, ek, clock, ck);
        Py_DECREF(rest);
        Py_DECREF(lv);
        if (leaf == NULL) {
            Py_DECREF(ck);
            goto done;
        }
        int r = PyDict_SetItem(node->children, ck, (PyObject *)leaf);
        Py_DECREF(ck);
        if (r < 0) {
            Py_DECREF(leaf);
            goto done;
        }
        node->dev_children += 1;
        evictable += n - pos;
        if (owned != NULL && owned_apply(owned, s_update, leaf->value) < 0) {
            Py_DECREF(leaf);
            goto done;
        }
        r = push_stamp(heap, clock, leaf);
        Py_DECREF(leaf);
        if (r < 0)
            goto done;
    }
    result = PyLong_FromSsize_t(pos);
done:
    key_release(&ck_view);
    key_release(&uk);
    if (wrote_clock && write_back(self, s_clock, clock) < 0)
        Py_CLEAR(result);
    if (evictable != ev0 && write_back(self, s_evictable, evictable) < 0)
        Py_CLEAR(result);
    if (protected_ != pr0 && write_back(self, s_protected, protected_) < 0)
        Py_CLEAR(result);
    Py_XDECREF(leaf_ck);
    Py_XDECREF(bounds);
    Py_XDECREF(child);
    Py_XDECREF(node);
    Py_XDECREF(heap);
    Py_XDECREF(alloc);
    Py_XDECREF(free_fn);
    Py_XDECREF(owned);
    Py_DECREF(root);
    return result;
#undef vd
}

/* ------------------------------------------------------------------------------------------ */
/* Locks                                                                                       */
/* ------------------------------------------------------------------------------------------ */

static Py_ssize_t
key_len(Node *node)
{
    return PyObject_Length(node->key);
}

/* inc_lock(root, node) -> (delta, [ids of the skipped evicted bottom nodes] or None) */
static PyObject *
core_inc_lock(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !IS_NODE(args[0]) || !IS_NODE(args[1])) {
        PyErr_SetString(PyExc_TypeError, "inc_lock(root, node)");
        return NULL;
    }
    Node *root = (Node *)args[0], *cur = (Node *)args[1];
    PyObject *skipped = NULL;
    while (cur != root && IS_NONE(cur->value)) {
        if (skipped == NULL && (skipped = PyList_New(0)) == NULL)
            return NULL;
        PyObject *id = PyLong_FromLongLong(cur->id);
        if (id == NULL || PyList_Append(skipped, id) < 0) {
            Py_XDECREF(id);
            Py_DECREF(skipped);
            return NULL;
        }
        Py_DECREF(id);
        if (!IS_NODE(cur->parent)) {
            Py_DECREF(skipped);
            PyErr_SetString(PyExc_TypeError, "a parent is not a TreeNode");
            return NULL;
        }
        cur = (Node *)cur->parent;
    }
    /* lengths first (the only step that can fail), then the counts */
    long long delta = 0;
    for (Node *c = cur; c != root; c = (Node *)c->parent) {
        if (!IS_NODE(c->parent)) {
            Py_XDECREF(skipped);
            PyErr_SetString(PyExc_TypeError, "a parent is not a TreeNode");
            return NULL;
        }
        if (c->lock_ref == 0) {
            Py_ssize_t k = key_len(c);
            if (k < 0) {
                Py_XDECREF(skipped);
                return NULL;
            }
            delta += k;
        }
    }
    for (Node *c = cur; c != root; c = (Node *)c->parent)
        c->lock_ref += 1;
    return Py_BuildValue("(LN)", delta, skipped ? skipped : Py_NewRef(Py_None));
}

/* dec_lock(root, node, skip set or None, heap) -> delta, or -1 when the path is not locked
 * (nothing changed) */
static PyObject *
core_dec_lock(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !IS_NODE(args[0]) || !IS_NODE(args[1]) || !PyList_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError, "dec_lock(root, node, skip, heap)");
        return NULL;
    }
    Node *root = (Node *)args[0], *node = (Node *)args[1];
    PyObject *skip = IS_NONE(args[2]) ? NULL : args[2];
    PyObject *heap = args[3];
    /* check first: a refused unlock changes nothing; note each node's skip status */
    long long delta = 0;
    for (Node *c = node; c != root; c = (Node *)c->parent) {
        if (!IS_NODE(c->parent)) {
            PyErr_SetString(PyExc_TypeError, "a parent is not a TreeNode");
            return NULL;
        }
        int skipped = 0;
        if (skip != NULL) {
            PyObject *id = PyLong_FromLongLong(c->id);
            if (id == NULL)
                return NULL;
            skipped = PySequence_Contains(skip, id);
            Py_DECREF(id);
            if (skipped < 0)
                return NULL;
        }
        if (!skipped) {
            if (c->lock_ref <= 0)
                return PyLong_FromLong(-1);
            if (c->lock_ref == 1) {
                Py_ssize_t k = key_len(c);
                if (k < 0)
                    return NULL;
            }
        }
    }
    for (Node *c = node; c != root; c = (Node *)c->parent) {
        int skipped = 0;
        if (skip != NULL) {
            PyObject *id = PyLong_FromLongLong(c->id);
            if (id == NULL)
                return NULL;
            skipped = PySequence_Contains(skip, id);
            Py_DECREF(id);
            if (skipped < 0)
                return NULL;
        }
        if (skipped)
            continue;
        c->lock_ref -= 1;
        if (c->lock_ref == 0) {
            Py_ssize_t k = key_len(c);
            if (k < 0)
                return NULL;
            delta += k;
            if (push_if_leaf(heap, c) < 0)
                return NULL;
        }
    }
    return PyLong_FromLongLong(delta);
}

/* ------------------------------------------------------------------------------------------ */
/* evict(cache, want) -> freed                                                                 */
/* ------------------------------------------------------------------------------------------ */

static int
detach(Node *parent, Node *child)
{
    if (!PyDict_CheckExact(parent->children)) {
        PyErr_SetString(PyExc_TypeError, "TreeNode.children must be a dict");
        return -1;
    }
    if (PyDict_DelItem(parent->children, child->ck ? child->ck : Py_None) < 0)
        return -1;
    SET_FIELD(child->parent, Py_None);
    return 0;
}

/* Two or more evicted values, every one a Slots: their concatenation in free order, made here
 * (one torch.empty and a copy each, where a view per value and torch.cat of them cost a
 * torch call per value more), handed with their lengths to the cache's _free_joined
 * (fast/cache.py), which frees it as fast/frees.py allows (one call where a free of the
 * concatenation is the same as a free of each in turn, else each as a view of it).  2 when
 * done, 0 when a value is not a Slots (nothing done), -1 on error. */
static int
free_joined(PyObject *self, PyObject *batch)
{
    Py_ssize_t n = PyList_GET_SIZE(batch), total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyList_GET_ITEM(batch, i);
        if (!IS_SLOTS(v))
            return 0;
        total += Py_SIZE(v);
    }
    if (ensure_torch() < 0)
        return -1;
    PyObject *lengths = PyList_New(n);
    if (lengths == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromSsize_t(Py_SIZE(PyList_GET_ITEM(batch, i)));
        if (x == NULL) {
            Py_DECREF(lengths);
            return -1;
        }
        PyList_SET_ITEM(lengths, i, x);
    }
    long long *dst;
    PyObject *joined = new_int64(total, &dst);
    if (joined == NULL) {
        Py_DECREF(lengths);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Slots *v = (Slots *)PyList_GET_ITEM(batch, i);
        if (Py_SIZE(v))
            memcpy(dst, v->data, (size_t)Py_SIZE(v) * sizeof(long long));
        dst += Py_SIZE(v);
    }
    PyObject *r = PyObject_CallMethodObjArgs(self, s_free_joined, joined, lengths, NULL);
    Py_DECREF(joined);
    Py_DECREF(lengths);
    return discard(r) < 0 ? -1 : 2;
}

/* fast/frees.py QUEUE_JOIN_MAX: under a QUEUE allocator, the average value length (slots) up
 * to which the values are joined (copied into one tensor) rather than freed one call each */
#define QUEUE_JOIN_MAX 256

/* Whether alloc's class declares fast/frees.py's QUEUE order (its free keeps the tensor it is
 * given at a small constant cost a call, so long values are better freed each as its view
 * than copied into one): 1, 0 or -1. */
static int
declares_queue(PyObject *alloc)
{
    PyObject *o = PyObject_GetAttr((PyObject *)Py_TYPE(alloc), s_free_order);
    if (o == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    int r = PyUnicode_Check(o) ? PyUnicode_Compare(o, s_queue) == 0 : 0;
    Py_DECREF(o);
    return r;
}

/* Hand the evicted nodes' values back: into sglang's exact allocators on the CPU directly
 * (native frees), else one piece straight to the allocator's own free (at any page size:
 * one free of one piece is exactly what one free per node does), else through the cache's
 * _free_values (fast/frees.py: as few calls as the allocator's semantics allow, the same
 * final free list as one call each).  Runs on the error path too (the nodes in ``batch`` have
 * left the tree), keeping the first error. */
static int
flush_frees(PyObject *self, PyObject *alloc, PyObject *batch)
{
    Py_ssize_t n = batch == NULL ? 0 : PyList_GET_SIZE(batch);
    if (n == 0)
        return 0;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    int native = alloc == NULL ? 0 : native_release_list(self, alloc, batch);
    PyObject *r = NULL;
    if (native == 0 && n > 1 && alloc != NULL) {  /* (QUEUE: long values are not joined) */
        Py_ssize_t total = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *v = PyList_GET_ITEM(batch, i);
            total += IS_SLOTS(v) ? Py_SIZE(v) : 0;
        }
        int q = total > (Py_ssize_t)QUEUE_JOIN_MAX * n ? declares_queue(alloc) : 0;
        if (q < 0)
            goto failed;
        if (q)
            native = 3;  /* (the Python path below: each value as its view) */
    }
    if (native == 1) {
        r = Py_NewRef(Py_None);
    } else if (native == 0 && n > 1 && (native = free_joined(self, batch)) < 0) {
        goto failed;
    } else if (native == 0 || native == 3) {
        /* the Python path frees tensors: a Slots value goes as its view */
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *v = PyList_GET_ITEM(batch, i);
            if (IS_SLOTS(v)) {
                PyObject *t = slots_view(v);
                if (t == NULL)
                    goto failed;
                PyList_SET_ITEM(batch, i, t);
                Py_DECREF(v);
            }
        }
        if (n == 1 && alloc != NULL) {
            PyObject *free_fn = PyObject_GetAttr(alloc, s_free);
            if (free_fn != NULL) {
                r = PyObject_CallOneArg(free_fn, PyList_GET_ITEM(batch, 0));
                Py_DECREF(free_fn);
            }
        } else {
            r = PyObject_CallMethodOneArg(self, s_free_values, batch);
        }
    } else if (native == 2) {
        r = Py_NewRef(Py_None);  /* done by free_joined */
    }
failed:
    Py_XDECREF(r);
    if (et != NULL) {
        if (r == NULL)
            PyErr_Clear();
        PyErr_Restore(et, ev, tb);
        return -1;
    }
    return r == NULL ? -1 : 0;
}

static PyObject *
core_evict(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(2, "evict(cache, num_tokens)");
    PyObject *self = args[0];
    long long want = PyLong_AsLongLong(args[1]);
    if (want == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return NULL;
        PyErr_Clear();  /* a huge num_tokens: evict everything evictable */
        want = LLONG_MAX;
    }
    Py_ssize_t ps;
    long long evictable, freed = 0;
    PyObject *heap = NULL, *alloc = NULL, *owned = NULL, *result = NULL;
    PyObject *batch = NULL;  /* the evicted values, freed together at the end */
    Node *root = get_root(self, 0, &ps);
    if (root == NULL)
        return NULL;
    if (get_ll(self, s_evictable, &evictable) < 0) {
        Py_DECREF(root);
        return NULL;
    }
    long long ev0 = evictable;
    heap = PyObject_GetAttr(self, s_heap);
    if (heap == NULL)
        goto done;
    if (!PyList_CheckExact(heap)) {
        PyErr_SetString(PyExc_TypeError, "_heap must be a list");
        goto done;
    }
    if ((alloc = PyObject_GetAttr(self, s_alloc)) == NULL || (batch = PyList_New(0)) == NULL)
        goto done;
    {
        PyObject *validate = PyObject_GetAttr(self, s_validate);
        if (validate == NULL)
            goto done;
        int v = PyObject_IsTrue(validate);
        Py_DECREF(validate);
        if (v < 0)
            goto done;
        if (v && (owned = PyObject_GetAttr(self, s_owned)) == NULL)
            goto done;
    }
    while (freed < want && PyList_GET_SIZE(heap) > 0) {
        PyObject *entry = heap_pop(heap);
        if (entry == NULL)
            goto done;
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2
                || !IS_NODE(PyTuple_GET_ITEM(entry, 1))) {
            Py_DECREF(entry);
            PyErr_SetString(PyExc_TypeError, "a heap entry is not (stamp, TreeNode)");
            goto done;
        }
        Node *node = (Node *)PyTuple_GET_ITEM(entry, 1);
        int ovf;
        long long stamp = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(entry, 0), &ovf);
        if (stamp == -1 && PyErr_Occurred()) {
            Py_DECREF(entry);
            goto done;
        }
        if (ovf || node->last_access_time != stamp || node->lock_ref || node->dev_children
                || IS_NONE(node->value) || IS_NONE(node->parent)) {
            Py_DECREF(entry);
            continue;  /* a stale entry */
        }
        Py_INCREF(node);
        Py_DECREF(entry);
        PyObject *value = node->value;
        Py_INCREF(value);
        if (PyList_Append(batch, value) < 0) {
            Py_DECREF(value);
            Py_DECREF(node);
            goto done;
        }
        if (owned != NULL && owned_apply(owned, s_difference_update, value) < 0) {
            Py_DECREF(value);
            Py_DECREF(node);
            goto done;
        }
        Py_DECREF(value);
        Py_ssize_t k = key_len(node);
        if (k < 0 || !IS_NODE(node->parent)) {
            if (k >= 0)
                PyErr_SetString(PyExc_TypeError, "a parent is not a TreeNode");
            Py_DECREF(node);
            goto done;
        }
        freed += k;
        evictable -= k;
        set_value(node, Py_None);
        Node *parent = (Node *)node->parent;
        Py_INCREF(parent);
        int rc = detach(parent, node);
        Py_DECREF(node);
        if (rc < 0) {
            Py_DECREF(parent);
            goto done;
        }
        parent->dev_children -= 1;
        while (parent != root && PyDict_CheckExact(parent->children)
                && PyDict_GET_SIZE(parent->children) == 0 && parent->lock_ref == 0
                && IS_NONE(parent->value)) {
            if (!IS_NODE(parent->parent)) {
                Py_DECREF(parent);
                PyErr_SetString(PyExc_TypeError, "a parent is not a TreeNode");
                goto done;
            }
            Node *up = (Node *)parent->parent;
            Py_INCREF(up);
            rc = detach(up, parent);
            Py_DECREF(parent);
            parent = up;
            if (rc < 0) {
                Py_DECREF(parent);
                goto done;
            }
        }
        if (parent->lock_ref == 0 && parent->dev_children == 0 && !IS_NONE(parent->value)
                && parent != root) {
            if (push_stamp(heap, parent->last_access_time, parent) < 0) {
                Py_DECREF(parent);
                goto done;
            }
        }
        Py_DECREF(parent);
    }
    result = PyLong_FromLongLong(freed);
done:
    if (flush_frees(self, alloc, batch) < 0)
        Py_CLEAR(result);
    if (evictable != ev0 && write_back(self, s_evictable, evictable) < 0)
        Py_CLEAR(result);
    Py_XDECREF(batch);
    Py_XDECREF(heap);
    Py_XDECREF(alloc);
    Py_XDECREF(owned);
    Py_DECREF(root);
    return result;
}


/* ------------------------------------------------------------------------------------------ */
/* The public methods' common case, whole: argument checks, the walk, the result object.       */
/* Each returns None, having changed nothing, when the call is not the plain case (a wrong     */
/* argument, EAGLE, a disabled cache, slot validation, an unaligned key...): the Python method  */
/* then runs its own code, which raises the same errors as always.                             */
/* ------------------------------------------------------------------------------------------ */

static PyObject *g_RadixKey, *g_MatchResult, *g_InsertResult, *g_IncResult, *g_DecResult,
    *g_EvictResult, *g_array;
static PyObject *s_key, *s_value, *s_prev, *s_chunked, *s_token_ids, *s_extra_key,
    *s_is_bigram, *s_is_eagle, *s_disable, *s_validate_slots, *s_empty, *s_dtype, *s_shape,
    *s_num_tokens, *s_skip, *s_compact, *s_zero;

#define DECLINE(x) do { Py_XDECREF(x); Py_RETURN_NONE; } while (0)

/* 1 if ``t``'s dtype is torch.int64 and its shape is one int (*n: that length); 0 if not;
 * -1 on error. */
static int
int64_1d_len(PyObject *t, Py_ssize_t *n)
{
    PyObject *o = PyObject_GetAttr(t, s_dtype);
    if (o == NULL)
        return -1;
    int ok = o == g_int64;
    Py_DECREF(o);
    if (!ok)
        return 0;
    if ((o = PyObject_GetAttr(t, s_shape)) == NULL)
        return -1;
    ok = PyTuple_Check(o) && PyTuple_GET_SIZE(o) == 1 && PyLong_Check(PyTuple_GET_ITEM(o, 0));
    if (ok) {
        *n = PyLong_AsSsize_t(PyTuple_GET_ITEM(o, 0));
        if (*n == -1 && PyErr_Occurred())
            ok = -1;
    }
    Py_DECREF(o);
    return ok;
}

/* 1 when self.<name> is False, 0 when it is anything else, -1 on error */
static int
attr_is_false(PyObject *self, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(self, name);
    if (v == NULL)
        return -1;
    int r = v == Py_False;
    Py_DECREF(v);
    return r;
}

/* The plain key of a RadixKey: its token array (new reference) and extra_key (new reference);
 * 0 when the key is not plain (declined), -1 on error.  Another type with RadixKey's shape
 * (SGLang's own) is plain too when its token_ids is an array('q') and its extra_key None or a
 * str (what uniradix's RadixKey guarantees by construction); anything else is declined and
 * the Python method converts it (fast/compat.py). */
static int
plain_key(PyObject *self, PyObject *key, PyObject **toks, PyObject **ek)
{
    int foreign = (PyObject *)Py_TYPE(key) != g_RadixKey;
    PyObject *b = PyObject_GetAttr(key, s_is_bigram);
    if (b == NULL) {
        if (foreign && PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    int bigram = b != Py_False;
    Py_DECREF(b);
    if (bigram)
        return 0;
    int r = attr_is_false(self, s_is_eagle);
    if (r <= 0)
        return r;
    if ((r = attr_is_false(self, s_disable)) <= 0)
        return r;
    PyObject *t = PyObject_GetAttr(key, s_token_ids);
    if (t == NULL) {
        if (foreign && PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    if ((PyObject *)Py_TYPE(t) != g_array) {
        Py_DECREF(t);
        return 0;
    }
    if (foreign) {
        Py_buffer view;
        if (PyObject_GetBuffer(t, &view, PyBUF_FORMAT) < 0) {
            Py_DECREF(t);
            return -1;
        }
        int q = view.itemsize == 8 && view.format != NULL && view.format[0] == 'q'
                && view.format[1] == '\0';
        PyBuffer_Release(&view);
        if (!q) {
            Py_DECREF(t);
            return 0;
        }
    }
    PyObject *e = PyObject_GetAttr(key, s_extra_key);
    if (e == NULL) {
        Py_DECREF(t);
        if (foreign && PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    if (foreign && e != Py_None && !PyUnicode_CheckExact(e)) {
        Py_DECREF(t);
        Py_DECREF(e);
        return 0;
    }
    *toks = t;
    *ek = e;
    return 1;
}

/* The end of a public call that can push onto the leaf heap (match_prefix, insert,
 * dec_lock_ref), as the Python path's UnifiedRadixCache._upkeep: where the heap's list
 * outgrew its LazyHeap's cap (touches with no eviction between pile up stale entries), the
 * cache's _compact_heap.  A cap is never under COMPACT_MIN (fast/structures.py), so a list
 * that short is left without reading it.  0, or -1 with an exception set. */
#define COMPACT_MIN 64
static PyObject *s_uk_leaf_heap, *s_uk_cap;

static int
heap_upkeep(PyObject *self)
{
    PyObject *heap = PyObject_GetAttr(self, s_heap);
    if (heap == NULL)
        return -1;
    Py_ssize_t len = PyList_CheckExact(heap) ? PyList_GET_SIZE(heap) : PyObject_Length(heap);
    Py_DECREF(heap);
    if (len <= COMPACT_MIN)
        return len < 0 ? -1 : 0;
    PyObject *lh = PyObject_GetAttr(self, s_uk_leaf_heap);
    if (lh == NULL)
        return -1;
    PyObject *cap = PyObject_GetAttr(lh, s_uk_cap);
    Py_DECREF(lh);
    if (cap == NULL)
        return -1;
    Py_ssize_t c = PyLong_AsSsize_t(cap);
    Py_DECREF(cap);
    if (c == -1 && PyErr_Occurred())
        return -1;
    return len <= c ? 0 : discard(PyObject_CallMethodNoArgs(self, s_compact));
}

static PyObject *
api_match(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(2, "match_prefix(cache, params)");
    PyObject *self = args[0];
    PyObject *key = PyObject_GetAttr(args[1], s_key), *toks = NULL, *ek = NULL;
    if (key == NULL)
        return NULL;
    int r = plain_key(self, key, &toks, &ek);
    Py_DECREF(key);
    if (r < 0)
        return NULL;
    if (r == 0)
        Py_RETURN_NONE;
    PyObject *ps_o = PyObject_GetAttr(self, s_page_size);
    if (ps_o == NULL)
        goto fail;
    Py_ssize_t ps = PyLong_AsSsize_t(ps_o);
    Py_DECREF(ps_o);
    if (ps == -1 && PyErr_Occurred())
        goto fail;
    Py_ssize_t n = PyObject_Length(toks);
    if (n < 0)
        goto fail;
    if (ps < 1 || n - n % ps == 0) {
        Py_DECREF(toks);
        Py_DECREF(ek);
        Py_RETURN_NONE;
    }
    PyObject *res = match_impl(self, toks, ek, ps);
    Py_DECREF(toks);
    Py_DECREF(ek);
    if (res == NULL)
        return NULL;
    if (heap_upkeep(self) < 0) {
        Py_DECREF(res);
        return NULL;
    }
    PyObject *indices = PyTuple_GET_ITEM(res, 0), *node = PyTuple_GET_ITEM(res, 1);
    PyObject *empty = NULL;
    if (indices == Py_None) {
        empty = PyObject_GetAttr(self, s_empty);
        if (empty == NULL) {
            Py_DECREF(res);
            return NULL;
        }
        indices = empty;
    }
    PyObject *items = PyTuple_Pack(9, indices, node, node, node, s_zero, s_zero, s_zero,
                                   Py_None, Py_None);
    Py_XDECREF(empty);
    Py_DECREF(res);
    if (items == NULL)
        return NULL;
    PyObject *targs = PyTuple_Pack(1, items);
    Py_DECREF(items);
    if (targs == NULL)
        return NULL;
    PyObject *out = PyTuple_Type.tp_new((PyTypeObject *)g_MatchResult, targs, NULL);
    Py_DECREF(targs);
    return out;
fail:
    Py_DECREF(toks);
    Py_DECREF(ek);
    return NULL;
}

static PyObject *
api_insert(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(2, "insert(cache, params)");
    PyObject *self = args[0], *params = args[1];
    PyObject *key = NULL, *toks = NULL, *ek = NULL, *value = NULL, *prev = NULL, *o = NULL;
    key = PyObject_GetAttr(params, s_key);
    if (key == NULL)
        return NULL;
    int r = plain_key(self, key, &toks, &ek);
    Py_DECREF(key);
    if (r <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_None);
    if ((r = attr_is_false(self, s_validate_slots)) <= 0)
        goto decline_or_fail;
    r = -1;
    if ((value = PyObject_GetAttr(params, s_value)) == NULL)
        goto decline_or_fail;
    r = 0;
    if ((PyObject *)Py_TYPE(value) != g_Tensor)
        goto decline_or_fail;
    r = -1;
    Py_ssize_t n = PyObject_Length(toks);
    if (n < 0)
        goto decline_or_fail;
    /* the value's metadata, read once for the whole call: a plain tensor's length and data
     * (kept for the insert's slices and frees), else its dtype and shape as before */
    VData vd = VDATA_INIT(value);
    if ((r = vdata_get(&vd)) < 0)
        goto decline_or_fail;
    if (r == 1) {
        r = 0;
        if (vd.n != n)
            goto decline_or_fail;
    } else {
        Py_ssize_t len0 = 0;
        if ((r = int64_1d_len(value, &len0)) <= 0)
            goto decline_or_fail;
        r = 0;
        if (len0 != n)
            goto decline_or_fail;
    }
    r = -1;
    if ((prev = PyObject_GetAttr(params, s_prev)) == NULL)
        goto decline_or_fail;
    r = 0;
    if (!PyLong_CheckExact(prev) || PyObject_RichCompareBool(prev, s_zero, Py_LT) != 0)
        goto decline_or_fail;
    r = -1;
    if ((o = PyObject_GetAttr(params, s_chunked)) == NULL)
        goto decline_or_fail;
    r = 0;
    if (o != Py_True && o != Py_False)
        goto decline_or_fail;
    Py_CLEAR(o);
    Py_ssize_t ps;
    {
        PyObject *ps_o = PyObject_GetAttr(self, s_page_size);
        if (ps_o == NULL) {
            r = -1;
            goto decline_or_fail;
        }
        ps = PyLong_AsSsize_t(ps_o);
        Py_DECREF(ps_o);
        if (ps == -1 && PyErr_Occurred()) {
            r = -1;
            goto decline_or_fail;
        }
        if (ps < 1 || n % ps)
            goto decline_or_fail;  /* an unaligned key: the Python path cuts it */
    }
    Py_ssize_t prev_n = PyLong_AsSsize_t(prev);
    if (prev_n == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            r = -1;
            goto decline_or_fail;
        }
        PyErr_Clear();  /* a huge prev_prefix_len: nothing is a duplicate */
        prev_n = PY_SSIZE_T_MAX;
    }
    PyObject *pos = insert_impl(self, toks, ek, value, prev_n, &vd, ps);
    Py_DECREF(toks);
    Py_DECREF(ek);
    Py_DECREF(value);
    Py_DECREF(prev);
    if (pos == NULL)
        return NULL;
    if (heap_upkeep(self) < 0) {
        Py_DECREF(pos);
        return NULL;
    }
    PyObject *a[1] = {pos};
    PyObject *out = PyObject_Vectorcall(g_InsertResult, a, 1, NULL);
    Py_DECREF(pos);
    return out;
decline_or_fail:
    Py_XDECREF(toks);
    Py_XDECREF(ek);
    Py_XDECREF(value);
    Py_XDECREF(prev);
    Py_XDECREF(o);
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* The node is a TreeNode in the tree (the root, or attached): 1; else 0 (declined); -1 error.
 * *root receives a new reference on 1. */
static int
attached(PyObject *self, PyObject *node, PyObject **root)
{
    if (!IS_NODE(node))
        return 0;
    int r = attr_is_false(self, s_disable);
    if (r <= 0)
        return r;
    PyObject *rt = PyObject_GetAttr(self, s_root_node);
    if (rt == NULL)
        return -1;
    if (!IS_NODE(rt) || (node != rt && IS_NONE(((Node *)node)->parent))) {
        Py_DECREF(rt);
        return 0;
    }
    *root = rt;
    return 1;
}

/* self.<ev> += d_ev; self.<pr> += d_pr */
static int
move_sizes(PyObject *self, long long d_ev, long long d_pr)
{
    long long ev, pr;
    if (d_ev == 0 && d_pr == 0)
        return 0;
    if (get_ll(self, s_evictable, &ev) < 0 || get_ll(self, s_protected, &pr) < 0)
        return -1;
    if (set_ll(self, s_evictable, ev + d_ev) < 0 || set_ll(self, s_protected, pr + d_pr) < 0)
        return -1;
    return 0;
}

static PyObject *
api_inc(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(2, "inc_lock_ref(cache, node)");
    PyObject *self = args[0], *root = NULL;
    int r = attached(self, args[1], &root);
    if (r <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *cargs[2] = {root, args[1]};
    PyObject *res = core_inc_lock(mod, cargs, 2);
    Py_DECREF(root);
    if (res == NULL)
        return NULL;
    long long delta = PyLong_AsLongLong(PyTuple_GET_ITEM(res, 0));
    PyObject *skipped = PyTuple_GET_ITEM(res, 1);
    PyObject *skip = PyDict_New(), *out = NULL;
    if (skip == NULL)
        goto done;
    if (skipped != Py_None) {
        PyObject *set = PySet_New(skipped);
        if (set == NULL || PyDict_SetItem(skip, s_zero, set) < 0) {
            Py_XDECREF(set);
            goto done;
        }
        Py_DECREF(set);
    }
    if (move_sizes(self, -delta, delta) < 0)
        goto done;
    {
        PyObject *a[4] = {PyTuple_GET_ITEM(res, 0), Py_None, Py_None, skip};
        out = PyObject_Vectorcall(g_IncResult, a, 4, NULL);
    }
done:
    Py_XDECREF(skip);
    Py_DECREF(res);
    return out;
}

static PyObject *
api_dec(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(3, "dec_lock_ref(cache, node, params)");
    PyObject *self = args[0], *params = args[2], *root = NULL, *skip = Py_None, *heap = NULL;
    PyObject *skipdict = NULL;
    int r = attached(self, args[1], &root);
    if (r <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_None);
    if (params != Py_None) {
        skipdict = PyObject_GetAttr(params, s_skip);
        if (skipdict == NULL)
            goto fail;
        if (!PyDict_CheckExact(skipdict)) {
            Py_DECREF(skipdict);
            Py_DECREF(root);
            Py_RETURN_NONE;
        }
        PyObject *s = PyDict_GetItemWithError(skipdict, s_zero);
        if (s == NULL && PyErr_Occurred())
            goto fail;
        if (s != NULL) {
            int t = PyObject_IsTrue(s);
            if (t < 0)
                goto fail;
            if (t)
                skip = s;
        }
    }
    heap = PyObject_GetAttr(self, s_heap);
    if (heap == NULL)
        goto fail;
    if (!PyList_CheckExact(heap)) {
        Py_DECREF(heap);
        Py_XDECREF(skipdict);
        Py_DECREF(root);
        Py_RETURN_NONE;
    }
    PyObject *cargs[4] = {root, args[1], skip, heap};
    PyObject *res = core_dec_lock(mod, cargs, 4);
    Py_DECREF(heap);
    Py_XDECREF(skipdict);
    Py_DECREF(root);
    if (res == NULL)
        return NULL;
    long long delta = PyLong_AsLongLong(res);
    if (delta < 0) {  /* not locked: the Python path raises HandleError (nothing changed) */
        Py_DECREF(res);
        Py_RETURN_NONE;
    }
    if (move_sizes(self, delta, -delta) < 0 || heap_upkeep(self) < 0) {
        Py_DECREF(res);
        return NULL;
    }
    PyObject *a[1] = {res};
    PyObject *out = PyObject_Vectorcall(g_DecResult, a, 1, NULL);
    Py_DECREF(res);
    return out;
fail:
    Py_XDECREF(skipdict);
    Py_DECREF(root);
    return NULL;
}

static PyObject *
api_evict(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(2, "evict(cache, params)");
    PyObject *self = args[0];
    PyObject *want = PyObject_GetAttr(args[1], s_num_tokens);
    if (want == NULL)
        return NULL;
    if (!PyLong_CheckExact(want) || PyObject_RichCompareBool(want, s_zero, Py_LT) != 0)
        DECLINE(want);
    int r = attr_is_false(self, s_disable);
    if (r <= 0) {
        Py_DECREF(want);
        return r < 0 ? NULL : Py_NewRef(Py_None);
    }
    PyObject *cargs[2] = {self, want};
    PyObject *freed = core_evict(mod, cargs, 2);
    Py_DECREF(want);
    if (freed == NULL)
        return NULL;
    /* compact the heap when stale entries outnumber live ones (as evict's Python code) */
    {
        long long ev, ps;
        PyObject *heap = PyObject_GetAttr(self, s_heap);
        if (heap == NULL || get_ll(self, s_evictable, &ev) < 0 || get_ll(self, s_page_size, &ps) < 0) {
            Py_XDECREF(heap);
            Py_DECREF(freed);
            return NULL;
        }
        Py_ssize_t len = PyObject_Length(heap);
        Py_DECREF(heap);
        if (len < 0) {
            Py_DECREF(freed);
            return NULL;
        }
        long long pp = ps > 1 ? ps : 1;
        /* Python's floor division */
        long long q = ev / pp;
        if ((ev % pp != 0) && ((ev < 0) != (pp < 0)))
            q -= 1;
        if (len > 64 && len > 4 * (q + 16)) {
            PyObject *c = PyObject_CallMethodNoArgs(self, s_compact);
            if (c == NULL) {
                Py_DECREF(freed);
                return NULL;
            }
            Py_DECREF(c);
        }
    }
    PyObject *a[1] = {freed};
    PyObject *out = PyObject_Vectorcall(g_EvictResult, a, 1, NULL);
    Py_DECREF(freed);
    return out;
}

static PyObject *
core_setup_api(PyObject *mod, PyObject *args)
{
    PyObject *o[9];
    if (!PyArg_ParseTuple(args, "OOOOOOOOO:setup_api", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5],
                          &o[6], &o[7], &o[8]))
        return NULL;
    PyObject **dst[9] = {&g_RadixKey, &g_MatchResult, &g_InsertResult, &g_IncResult,
                         &g_DecResult, &g_EvictResult, &g_Tensor, &g_int64, &g_array};
    if (!PyType_Check(o[1]) || !PyType_IsSubtype((PyTypeObject *)o[1], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "setup_api: MatchResult must be a tuple subclass");
        return NULL;
    }
    for (int i = 0; i < 9; i++) {
        Py_INCREF(o[i]);
        Py_XSETREF(*dst[i], o[i]);
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------ */
/* setup, heap helpers for tests, module                                                       */
/* ------------------------------------------------------------------------------------------ */

static PyObject *
core_setup(PyObject *mod, PyObject *args)
{
    PyObject *nc, *cat;
    long long stride;
    if (!PyArg_ParseTuple(args, "OOL:setup", &nc, &cat, &stride))
        return NULL;
    Py_INCREF(nc);
    Py_XSETREF(g_narrow_copy, nc);
    Py_INCREF(cat);
    Py_XSETREF(g_cat, cat);
    g_stride = stride;
    Py_RETURN_NONE;
}

static PyObject *core_native_release_own(PyObject *alloc, PyObject *pieces);  /* (swa_free's block) */

/* native_release(holder, alloc, pieces) -> bool: the native frees of a list of tensors, the
 * tail buffer kept on holder (the cache, or the allocator's holder from fast/frees.py
 * tail_holder); False where the Python path must run (nothing
 * changed).  What evict calls; exposed for the exactness tests. */
static PyObject *
core_native_release(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "native_release(holder, alloc, pieces: list)");
        return NULL;
    }
    if (args[0] == Py_None)  /* the allocator's own holder (swa_free's table) */
        return core_native_release_own(args[1], args[2]);
    int r = native_release_list(args[0], args[1], args[2]);
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}

/* free_timer(clock) -> seconds: the free timer's sum so far, then reset to 0, and the timer
 * set to clock (0 off, 1 wall, 2 this thread's CPU time; see native_release). */
static PyObject *
core_free_timer(PyObject *mod, PyObject *arg)
{
    long c = PyLong_AsLong(arg);
    if (c == -1 && PyErr_Occurred())
        return NULL;
    if (c < 0 || c > 2) {
        PyErr_Format(PyExc_ValueError, "free_timer: clock must be 0 (off), 1 (wall) or 2 "
                     "(thread CPU time), got %ld", c);
        return NULL;
    }
    double sum = g_free_seconds;
    g_free_seconds = 0.0;
    g_free_clock = (int)c;
    return PyFloat_FromDouble(sum);
}

static PyObject *
core_setup_frees(PyObject *mod, PyObject *args)
{
    PyObject *empty, *classify;
    if (!PyArg_ParseTuple(args, "OO:setup_frees", &empty, &classify))
        return NULL;
    if (g_empty_kw == NULL && (g_empty_kw = Py_BuildValue("(s)", "dtype")) == NULL)
        return NULL;
    Py_XSETREF(g_empty, Py_NewRef(empty));
    Py_XSETREF(g_classify, Py_NewRef(classify));
    for (int i = 0; i < KIND_SLOTS; i++) {  /* classify again with the new function */
        Py_CLEAR(g_kinds[i].type);
        Py_CLEAR(g_kinds[i].free);
    }
    Py_RETURN_NONE;
}

static PyObject *
core_heappush(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "heappush(list, entry)");
        return NULL;
    }
    if (heap_push(args[0], args[1]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
core_heappop(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "heappop(list)");
        return NULL;
    }
    if (PyList_GET_SIZE(args[0]) == 0) {
        PyErr_SetString(PyExc_IndexError, "index out of range");
        return NULL;
    }
    return heap_pop(args[0]);
}

/* ------------------------------------------------------------------------------------------ */
/* paged_front(pieces, page_size) -> bytearray                                                */
/* ------------------------------------------------------------------------------------------ */

/* What k calls of a sorted-prepend paged free (sglang's PagedTokenToKVPoolAllocator.free: the
 * sorted distinct pages of what it is given go in front of its list) put in front of the list,
 * in one pass: the sorted distinct floor(slot / page_size) of each piece, the last piece's
 * first.  Each piece must be a torch.Tensor (exactly), 1-D, contiguous, int64, on the CPU
 * (checked here: its memory is read through data_ptr() and numel()); if one is not, None.
 * The bytes are int64s in native order, for torch.frombuffer (fast/frees.py). */

static int
cmp_ll(const void *a, const void *b)
{
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

static long long
floor_div_ll(long long a, long long b)
{
    long long q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

/* 1 if ``t`` is a torch.Tensor (exactly) of int64 on the CPU, 1-D and contiguous, so its
 * memory can be read as *n int64s from data_ptr() (*n: its length, from its shape); 0 if not;
 * -1 on error. */
static int
piece_is_plain(PyObject *t, Py_ssize_t *n)
{
    if (g_Tensor == NULL || (PyObject *)Py_TYPE(t) != g_Tensor)
        return 0;
    int ok = int64_1d_len(t, n);
    if (ok <= 0)
        return ok;
    PyObject *o = PyObject_GetAttr(t, s_is_cpu);
    if (o == NULL)
        return -1;
    ok = o == Py_True;
    Py_DECREF(o);
    if (!ok)
        return 0;
    if ((o = PyObject_CallMethodNoArgs(t, s_is_contiguous)) == NULL)
        return -1;
    ok = o == Py_True;
    Py_DECREF(o);
    return ok;
}

/* The front (see above) of segs into a new PyMem buffer *out (the caller frees it); its
 * length, or -1 on error. */
static Py_ssize_t
paged_front_into(const Seg *segs, Py_ssize_t k, long long ps, long long **out)
{
    Py_ssize_t cap = 0, used = 0;
    for (Py_ssize_t i = 0; i < k; i++)
        cap += segs[i].n;
    *out = PyMem_Malloc((size_t)(cap ? cap : 1) * sizeof(long long));
    if (*out == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = k - 1; i >= 0; i--) {
        const long long *src = segs[i].p;
        Py_ssize_t n = segs[i].n;
        long long *seg = *out + used, prev = 0, lo = 0, hi = 0;
        Py_ssize_t m = 0;
        int sorted = 1;
        for (Py_ssize_t j = 0; j < n; j++) {
            long long v = src[j];
            if (ps > 1 && v >= 0 && j + ps <= n && v % ps == 0 && v <= LLONG_MAX - ps) {
                /* a whole page in order (v, v + 1, ..., v + ps - 1: how a paged allocator
                 * hands pages out, so nearly every block of a node's slots) is one page: the
                 * block compared at once (no early exit, so the compiler can vectorise it)
                 * instead of a branch per slot; anything else takes the slot-by-slot path */
                long long bad = 0;
                for (long long t = 1; t < ps; t++)
                    bad |= src[j + t] ^ (v + t);
                if (!bad) {
                    long long pg = v / ps;
                    if (!(m && pg == prev)) {
                        if (m && pg < prev)
                            sorted = 0;
                        seg[m++] = prev = pg;
                        lo = v;
                        hi = v + ps;
                    }
                    j += ps - 1;
                    continue;
                }
            }
            if (m && v >= lo && v < hi)
                continue;  /* the rest of a page already taken: [lo, hi) are its slots
                            * (a compare instead of a division per slot) */
            long long pg = floor_div_ll(v, ps);
            if (m && pg == prev)
                continue;
            if (m && pg < prev)
                sorted = 0;
            seg[m++] = prev = pg;
            /* (an empty range below slot 0 or where lo + ps would overflow: the division
             * then decides; lo = pg * ps <= v cannot overflow for pg >= 0) */
            lo = pg >= 0 ? pg * ps : 0;
            hi = (pg >= 0 && lo <= LLONG_MAX - ps) ? lo + ps : lo;
        }
        if (!sorted)
            qsort(seg, (size_t)m, sizeof(long long), cmp_ll);
        Py_ssize_t u = 0;
        for (Py_ssize_t j = 0; j < m; j++)
            if (u == 0 || seg[j] != seg[u - 1])
                seg[u++] = seg[j];
        used += u;
    }
    return used;
}

static PyObject *
core_paged_front(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "paged_front(pieces: list, page_size)");
        return NULL;
    }
    PyObject *pieces = args[0];
    long long ps = PyLong_AsLongLong(args[1]);
    if (ps == -1 && PyErr_Occurred())
        return NULL;
    if (ps <= 0) {
        PyErr_SetString(PyExc_ValueError, "page_size must be positive");
        return NULL;
    }
    Py_ssize_t k = PyList_GET_SIZE(pieces);
    Seg *segs = PyMem_Malloc((size_t)(k ? k : 1) * sizeof(Seg));
    long long *out = NULL;
    PyObject *result = NULL;
    if (segs == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < k; i++) {
        int ok = plain_data(PyList_GET_ITEM(pieces, i), &segs[i].p, &segs[i].n);
        if (ok < 0)
            goto done;
        if (ok == 0) {  /* not one this pass may read: the caller takes another way */
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    Py_ssize_t used = paged_front_into(segs, k, ps, &out);
    if (used >= 0)
        result = PyByteArray_FromStringAndSize((const char *)out,
                                               (Py_ssize_t)(used * (Py_ssize_t)sizeof(long long)));
done:
    PyMem_Free(out);
    PyMem_Free(segs);
    return result;
}

static PyObject *core_match_step(PyObject *, PyObject *const *, Py_ssize_t);  /* (at the end) */
static PyObject *core_match_step_setup(PyObject *, PyObject *const *, Py_ssize_t);

/* ---- SWA slots through sglang's map (fast/components/swa.py, fast/one_aux.py) ------------ */
/*
 * sglang's SWATokenToKVPoolAllocator keeps, for each full slot, its SWA slot in an int64 CPU
 * tensor (full_to_swa_index_mapping, read through its pool's translate_loc_from_full_to_swa as
 * that tensor indexed by the full slots: a new tensor).  Measured in situ (a one-component
 * SWA insert, shared-prefix page 1) that call was 15 us of a 51 us insert: two Python methods,
 * an assert and torch's advanced indexing.  Here the map is read directly, only where the
 * caller has made sure it is exactly sglang's (fast/components/swa.py SwaComponent): the same
 * values, in a new int64 tensor, as that indexing returns.  Nothing here writes the map.
 */

/* mapping at idx[0:n] (mapping's length mn) as a new int64 tensor, read and checked in one
 * pass; Py_None (a new reference; nothing else made) where a slot lies outside [0, mn) (where
 * torch's indexing would wrap a negative one or raise); NULL on error. */
static PyObject *
gather_new(const long long *map, Py_ssize_t mn, const long long *idx, Py_ssize_t n)
{
    long long *dst;
    PyObject *t = new_int64(n, &dst);
    if (t == NULL)
        return NULL;
    for (Py_ssize_t j = 0; j < n; j++) {
        if (j + SWA_PREFETCH < n) {  /* as swa_free's walk: the map's lines ahead, read */
            long long a = idx[j + SWA_PREFETCH];
            if (a >= 0 && a < mn)
                __builtin_prefetch(&map[a], 0, 1);
        }
        long long k = idx[j];
        if (k < 0 || k >= mn) {
            Py_DECREF(t);
            Py_RETURN_NONE;
        }
        dst[j] = map[k];
    }
    return t;
}

/* swa_gather(mapping, full) -> mapping[full] as a new int64 tensor; None (nothing done) where
 * either is not a plain CPU int64 tensor or a slot of full lies outside [0, len(mapping)):
 * the caller runs sglang's own method then. */
static PyObject *
core_swa_gather(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(2, "swa_gather(mapping, full)");
    const long long *mp, *fp;
    Py_ssize_t mn, fn;
    int ok = plain_data(args[0], &mp, &mn);
    if (ok > 0)
        ok = plain_data(args[1], &fp, &fn);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    return gather_new(mp, mn, fp, fn);
}

/* ---- state_copy: a Mamba state's own copy, from a slab -------------------------------- */
/*
 * An insert's Mamba state is copied (fast/components/mamba.py mamba_state: the tree holds a
 * tensor no later write to the caller's can change).  ``clone()`` is a whole torch op per
 * insert; here a slab of STATE_SLAB int64 slots is made once (torch.empty and one split into
 * one-slot views) and each copy is the next view with the state's value written into it:
 * a one-slot int64 CPU tensor of its own value that nothing else holds or writes (the slab
 * keeps the views until it is used up and replaced; a view keeps the slab's memory alive).
 */
#define STATE_SLAB 256
static PyObject *g_slab_views = NULL;  /* the current slab's views (a tuple), or NULL */
static long long *g_slab_data = NULL;
static Py_ssize_t g_slab_next = 0;

/* state_copy(state) -> a one-slot int64 CPU tensor holding state's value (see above), or
 * None (nothing done) where state is not a plain one-slot CPU int64 tensor: the caller
 * clones it. */
static PyObject *
core_state_copy(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(1, "state_copy(state)");
    const long long *p;
    Py_ssize_t n;
    int ok = plain_data(args[0], &p, &n);
    if (ok <= 0 || n != 1)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    if (g_slab_views == NULL || g_slab_next >= PyTuple_GET_SIZE(g_slab_views)) {
        long long *data;
        PyObject *slab = new_int64(STATE_SLAB, &data);
        if (slab == NULL)
            return NULL;
        PyObject *one = PyLong_FromLong(1);
        PyObject *views = one == NULL ? NULL : PyObject_CallMethod(slab, "split", "O", one);
        Py_XDECREF(one);
        Py_DECREF(slab);
        if (views == NULL)
            return NULL;
        if (!PyTuple_CheckExact(views) || PyTuple_GET_SIZE(views) != STATE_SLAB) {
            Py_DECREF(views);
            Py_RETURN_NONE;
        }
        Py_XSETREF(g_slab_views, views);
        g_slab_data = data;
        g_slab_next = 0;
    }
    g_slab_data[g_slab_next] = p[0];
    return Py_NewRef(PyTuple_GET_ITEM(g_slab_views, g_slab_next++));
}

/* swa_leaf(value, start, length, mapping) -> (value[start:start + length] copied into a new
 * int64 tensor, mapping at those slots as a new int64 tensor): an insert's new leaf, its Full
 * slots (torch.narrow_copy's values) and its SWA slots, in one call.  None (nothing done) as
 * swa_gather, and where the range is not inside value. */
static PyObject *
core_swa_leaf(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(4, "swa_leaf(value, start, length, mapping)");
    Py_ssize_t start = PyLong_AsSsize_t(args[1]), length = PyLong_AsSsize_t(args[2]);
    if ((start == -1 || length == -1) && PyErr_Occurred())
        return NULL;
    const long long *vp, *mp;
    Py_ssize_t vn, mn;
    int ok = plain_data(args[0], &vp, &vn);
    if (ok > 0)
        ok = plain_data(args[3], &mp, &mn);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    if (start < 0 || length < 0 || start > vn || length > vn - start)
        Py_RETURN_NONE;
    const long long *src = vp + start;
    PyObject *swa = gather_new(mp, mn, src, length);
    if (swa == NULL || swa == Py_None)
        return swa;
    long long *dst;
    PyObject *full = new_int64(length, &dst);
    if (full == NULL) {
        Py_DECREF(swa);
        return NULL;
    }
    if (length)
        memcpy(dst, src, (size_t)length * sizeof(long long));
    PyObject *pair = PyTuple_Pack(2, full, swa);
    Py_DECREF(full);
    Py_DECREF(swa);
    return pair;
}

/* ------------------------------------------------------------------------------------------ */
/* Python-node fields: the composed tree's nodes and records, read and written in place       */
/* ------------------------------------------------------------------------------------------ */
/*
 * The composed tree (fast/hybrid.py, fast/one_aux.py) keeps its nodes as the pure-Python
 * classes fast/node.py Node, fast/components AuxData (one record per aux component) and
 * fast/structures.py _Sentinel (an LRU list's ends), all with __slots__.  A slot is a
 * PyObject * at a fixed offset in the instance, which the class's member descriptor names;
 * setup_pynode reads those offsets once, so the C paths of the composed tree read and write
 * the fields directly, as the interpreter's specialised LOAD_ATTR / STORE_ATTR on a slot do,
 * without a type lookup per access.  Rules that keep this exactly as safe as attribute access:
 *  - only an object whose type IS the registered class is accessed through its offsets
 *    (PN_IS, AD_IS, SE_IS); anything else goes through the Python path;
 *  - a slot that is unset (NULL) reads as an AttributeError naming the field, as Python's;
 *  - a write takes a new reference and drops the old one after the store (Py_XSETREF).
 */

static PyTypeObject *g_pn_type, *g_ad_type = NULL, *g_se_type = NULL;

/* Node (fast/node.py) */
static Py_ssize_t PN_children, PN_parent, PN_key, PN_value, PN_lock_ref, PN_last_access_time,
    PN_hit_count, PN_extra_key, PN_dev_children, PN_id, PN_ck, PN_host_value, PN_host_lock_ref,
    PN_aux, PN_aux_lock, PN_created, PN_priority;
/* AuxData (fast/components/__init__.py) */
static Py_ssize_t AD_node, AD_value, AD_lock, AD_boundary, AD_lru_prev, AD_lru_next,
    AD_host_value, AD_host_lock, AD_host_boundary, AD_former_parent, AD_split_from;
/* _Sentinel (fast/structures.py) */
static Py_ssize_t SE_lru_prev, SE_lru_next;

#define PN_IS(o) ((PyTypeObject *)Py_TYPE(o) == g_pn_type)
#define AD_IS(o) ((PyTypeObject *)Py_TYPE(o) == g_ad_type)
#define SE_IS(o) ((PyTypeObject *)Py_TYPE(o) == g_se_type)
#define SLOT_AT(o, off) (*(PyObject **)((char *)(o) + (off)))

/* The offset of slot `name` of class tp: its member descriptor must be a writable object
 * slot (what __slots__ makes). */
static int
pyslot_offset(PyTypeObject *tp, const char *name, Py_ssize_t *off)
{
    PyObject *d = PyDict_GetItemString(tp->tp_dict, name);  /* borrowed */
    if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyErr_Format(PyExc_TypeError, "setup_pynode: %s.%s is not a __slots__ field",
                     tp->tp_name, name);
        return -1;
    }
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    if (m->type != T_OBJECT_EX || (m->flags & READONLY) || m->offset <= 0) {
        PyErr_Format(PyExc_TypeError, "setup_pynode: %s.%s is not a writable object slot",
                     tp->tp_name, name);
        return -1;
    }
    *off = m->offset;
    return 0;
}

/* A field's value (borrowed), or NULL with AttributeError when it is unset. */
static inline PyObject *
pyslot_get(PyObject *o, Py_ssize_t off, const char *name)
{
    PyObject *v = SLOT_AT(o, off);
    if (v == NULL)
        PyErr_Format(PyExc_AttributeError, "'%.100s' object has no attribute '%s'",
                     Py_TYPE(o)->tp_name, name);
    return v;
}

/* Store v (borrowed; a new reference is taken) in a field. */
static inline void
pyslot_set(PyObject *o, Py_ssize_t off, PyObject *v)
{
    Py_XSETREF(SLOT_AT(o, off), Py_NewRef(v));
}

/* An int field as a C long long: -1 with the error set when it is unset or not an int. */
static inline int
pyslot_ll(PyObject *o, Py_ssize_t off, const char *name, long long *out)
{
    PyObject *v = pyslot_get(o, off, name);
    if (v == NULL)
        return -1;
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    *out = x;
    return 0;
}

/* Store a C long long in an int field; -1 when the int cannot be made. */
static inline int
pyslot_set_ll(PyObject *o, Py_ssize_t off, long long x)
{
    PyObject *v = PyLong_FromLongLong(x);
    if (v == NULL)
        return -1;
    Py_XSETREF(SLOT_AT(o, off), v);
    return 0;
}

/* The offsets of the LRU links of an LRU list member: an AuxData record or a sentinel; 0 for
 * anything else (the caller declines or raises). */
static inline Py_ssize_t
lru_prev_off(PyObject *o)
{
    return AD_IS(o) ? AD_lru_prev : SE_IS(o) ? SE_lru_prev : 0;
}

static inline Py_ssize_t
lru_next_off(PyObject *o)
{
    return AD_IS(o) ? AD_lru_next : SE_IS(o) ? SE_lru_next : 0;
}

/* Every field the C paths use: its class (0 Node, 1 AuxData, 2 _Sentinel), where its offset
 * is kept, its name. */
static const struct { int cls; Py_ssize_t *var; const char *name; } g_pyslot_fields[] = {
    {0, &PN_children, "children"},
    {0, &PN_parent, "parent"},
    {0, &PN_key, "key"},
    {0, &PN_value, "value"},
    {0, &PN_lock_ref, "lock_ref"},
    {0, &PN_last_access_time, "last_access_time"},
    {0, &PN_hit_count, "hit_count"},
    {0, &PN_extra_key, "extra_key"},
    {0, &PN_dev_children, "dev_children"},
    {0, &PN_id, "id"},
    {0, &PN_ck, "ck"},
    {0, &PN_host_value, "host_value"},
    {0, &PN_host_lock_ref, "host_lock_ref"},
    {0, &PN_aux, "aux"},
    {0, &PN_aux_lock, "aux_lock"},
    {0, &PN_created, "created"},
    {0, &PN_priority, "priority"},
    {1, &AD_node, "node"},
    {1, &AD_value, "value"},
    {1, &AD_lock, "lock"},
    {1, &AD_boundary, "boundary"},
    {1, &AD_lru_prev, "lru_prev"},
    {1, &AD_lru_next, "lru_next"},
    {1, &AD_host_value, "host_value"},
    {1, &AD_host_lock, "host_lock"},
    {1, &AD_host_boundary, "host_boundary"},
    {1, &AD_former_parent, "former_parent"},
    {1, &AD_split_from, "split_from"},
    {2, &SE_lru_prev, "lru_prev"},
    {2, &SE_lru_next, "lru_next"},
};
#define N_PYSLOT_FIELDS ((int)(sizeof(g_pyslot_fields) / sizeof(g_pyslot_fields[0])))

/* setup_pynode(Node, AuxData, _Sentinel): read the three classes' slot offsets. */
static PyObject *
core_setup_pynode(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyType_Check(args[0]) || !PyType_Check(args[1]) || !PyType_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "setup_pynode(Node, AuxData, _Sentinel): three classes");
        return NULL;
    }
    PyTypeObject *pn = (PyTypeObject *)args[0], *ad = (PyTypeObject *)args[1],
                 *se = (PyTypeObject *)args[2];
    /* every offset is read before any is stored, so a refused call changes nothing */
    PyTypeObject *tps[3] = {pn, ad, se};
    Py_ssize_t offs[N_PYSLOT_FIELDS];
    for (int i = 0; i < N_PYSLOT_FIELDS; i++)
        if (pyslot_offset(tps[g_pyslot_fields[i].cls], g_pyslot_fields[i].name, &offs[i]) < 0)
            return NULL;
    for (int i = 0; i < N_PYSLOT_FIELDS; i++)
        *g_pyslot_fields[i].var = offs[i];
    Py_INCREF(pn);
    Py_INCREF(ad);
    Py_INCREF(se);
    Py_XSETREF(g_pn_type, pn);
    Py_XSETREF(g_ad_type, ad);
    Py_XSETREF(g_se_type, se);
    Py_RETURN_NONE;
}

/* pynode_get(obj, name) -> the field read through its offset (what the C paths see), for the
 * tests that check the offsets against Python's own attribute access. */
static PyObject *
core_pynode_get(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "pynode_get(obj, name)");
        return NULL;
    }
    PyObject *o = args[0];
    int cls = PN_IS(o) ? 0 : AD_IS(o) ? 1 : SE_IS(o) ? 2 : -1;
    if (cls < 0) {
        PyErr_SetString(PyExc_TypeError, "pynode_get: not a registered class (setup_pynode)");
        return NULL;
    }
    const char *name = PyUnicode_AsUTF8(args[1]);
    if (name == NULL)
        return NULL;
    Py_ssize_t off = 0;
    for (int i = 0; i < N_PYSLOT_FIELDS; i++)
        if (g_pyslot_fields[i].cls == cls && strcmp(g_pyslot_fields[i].name, name) == 0)
            off = *g_pyslot_fields[i].var;
    if (off == 0) {
        PyErr_Format(PyExc_TypeError, "pynode_get: %s is not a field the C paths use", name);
        return NULL;
    }
    PyObject *v = pyslot_get(o, off, name);
    return v == NULL ? NULL : Py_NewRef(v);
}

/* ---- the same fields where an object may be of another class ----------------------------- */
/*
 * The composed tree's C paths meet objects they have not checked: what a Python call they
 * make (a split, a callback) hands back, a cache or component attribute.  These helpers are
 * the one way the paths read and write such a field: through its slot where the object is
 * exactly the class that has it, else through Python's attribute access with the field's
 * interned name (below), so the steps are the Python path's steps either way.  Their one
 * convention:
 *  - a read returns a NEW reference (the attribute access makes one), NULL with the error
 *    set; an unset slot raises the AttributeError Python's access raises;
 *  - a write takes v borrowed (the slot takes its own reference, as pyslot_set);
 *  - `off` is the field's offset where the caller found the object to be of the field's
 *    class (PN_OFF, AD_OFF, lru_prev_off / lru_next_off), 0 for Python's access; an
 *    attribute of a cache or component (no slot) is read with off 0.
 * pyslot_get (borrowed, no fallback) stays for objects whose class the caller checked.
 */

/* the names of the fields and attributes the composed tree's C paths read */
static PyObject *s_children, *s_parent, *s_lock_ref, *s_aux_lock, *s_dev_children,
    *s_last_access_time, *s_aux, *s_lru_prev, *s_lru_next, *s_lru, *s_head, *s_events,
    *s_split_m, *s_comp_evictable, *s_comp_protected;

#define PN_OFF(o, field) (PN_IS(o) ? (field) : 0)
#define AD_OFF(o, field) (AD_IS(o) ? (field) : 0)
/* a Node's / an AuxData's field by its name: PN_GET(node, value) is node.value */
#define PN_GET(o, f) pyfield_get((o), PN_OFF((o), PN_##f), s_##f)
#define AD_GET(o, f) pyfield_get((o), AD_OFF((o), AD_##f), s_##f)
#define PN_SET(o, f, v) pyfield_set((o), PN_OFF((o), PN_##f), s_##f, (v))
#define AD_SET(o, f, v) pyfield_set((o), AD_OFF((o), AD_##f), s_##f, (v))
/* an LRU list member's link: LRU_GET(rec, next) is rec.lru_next */
#define LRU_GET(o, f) pyfield_get((o), lru_##f##_off(o), s_lru_##f)
#define LRU_SET(o, f, v) pyfield_set((o), lru_##f##_off(o), s_lru_##f, (v))

/* o.name: new reference (see above). */
static PyObject *
pyfield_get(PyObject *o, Py_ssize_t off, PyObject *name)
{
    if (off > 0) {
        PyObject *v = SLOT_AT(o, off);
        if (v == NULL) {
            PyErr_Format(PyExc_AttributeError, "'%.100s' object has no attribute '%U'",
                         Py_TYPE(o)->tp_name, name);
            return NULL;
        }
        return Py_NewRef(v);
    }
    return PyObject_GetAttr(o, name);
}

/* o.name = v (borrowed); 0 or -1. */
static int
pyfield_set(PyObject *o, Py_ssize_t off, PyObject *name, PyObject *v)
{
    if (off > 0) {
        pyslot_set(o, off, v);
        return 0;
    }
    return PyObject_SetAttr(o, name, v);
}

/* LruList.insert_after(prev, rec) as the Python paths write it inline (push_front: prev is
 * the head): nxt = prev.lru_next; rec.lru_prev, rec.lru_next = prev, nxt;
 * prev.lru_next = nxt.lru_prev = rec.  0 or -1. */
static int
lru_link_after(PyObject *prev, PyObject *rec)
{
    PyObject *nxt = LRU_GET(prev, next);
    if (nxt == NULL)
        return -1;
    int rc = -1;
    if (LRU_SET(rec, prev, prev) == 0 && LRU_SET(rec, next, nxt) == 0
            && LRU_SET(prev, next, rec) == 0 && LRU_SET(nxt, prev, rec) == 0)
        rc = 0;
    Py_DECREF(nxt);
    return rc;
}

/* LruList.move_after(prev, rec) as fast/one_aux.py writes it inline: rec out of its place,
 * rec.lru_prev.lru_next = rec.lru_next then rec.lru_next.lru_prev = rec.lru_prev (each
 * statement's reads in Python's order: the value, then the object it is stored on), then
 * lru_link_after(prev, rec).  0 or -1. */
static int
lru_move_after(PyObject *prev, PyObject *rec)
{
    int rc = -1;
    PyObject *a = NULL, *b = NULL;
    if ((b = LRU_GET(rec, next)) == NULL
            || (a = LRU_GET(rec, prev)) == NULL
            || LRU_SET(a, next, b) < 0)
        goto done;
    Py_CLEAR(a);
    Py_CLEAR(b);
    if ((a = LRU_GET(rec, prev)) == NULL
            || (b = LRU_GET(rec, next)) == NULL
            || LRU_SET(b, prev, a) < 0)
        goto done;
    rc = lru_link_after(prev, rec);
done:
    Py_XDECREF(a);
    Py_XDECREF(b);
    return rc;
}

/* node.aux[0], the node's one component record (the composed tree with one aux component):
 * a new reference, read as Python indexes it (its errors for an aux that is not a non-empty
 * tuple). */
static PyObject *
pn_rec(PyObject *node)
{
    PyObject *aux = PN_GET(node, aux);
    if (aux == NULL)
        return NULL;
    PyObject *rec = PyTuple_CheckExact(aux) && PyTuple_GET_SIZE(aux) > 0
        ? Py_NewRef(PyTuple_GET_ITEM(aux, 0)) : PySequence_GetItem(aux, 0);
    Py_DECREF(aux);
    return rec;
}

/* node.aux[i], one of the node's component records (the composed tree with two aux
 * components: pair_match): a new reference, read as Python indexes it. */
static PyObject *
pn_rec_at(PyObject *node, Py_ssize_t i)
{
    PyObject *aux = PN_GET(node, aux);
    if (aux == NULL)
        return NULL;
    PyObject *rec = PyTuple_CheckExact(aux) && PyTuple_GET_SIZE(aux) > i
        ? Py_NewRef(PyTuple_GET_ITEM(aux, i)) : PySequence_GetItem(aux, i);
    Py_DECREF(aux);
    return rec;
}

/* `rec.value is not None` (a record holds its component's data): 1, 0, or -1. */
static int
rec_holds(PyObject *rec)
{
    PyObject *v = AD_GET(rec, value);
    if (v == NULL)
        return -1;
    int held = v != Py_None;
    Py_DECREF(v);
    return held;
}

/* A step of path_to_front: the record rec (a new reference, consumed) moved to just after *at
 * in its LRU list where it holds data (LruList.move_after, inlined), and then *at is rec; a
 * record without data stays where it is.  0 or -1. */
static int
rec_to_front(PyObject **at, PyObject *rec)
{
    int held = rec_holds(rec);
    if (held <= 0 || lru_move_after(*at, rec) < 0) {
        Py_DECREF(rec);
        return held <= 0 ? held : -1;
    }
    Py_SETREF(*at, rec);
    return 0;
}

/* len(node.key); -1 with the error set. */
static Py_ssize_t
pn_key_len(PyObject *node)
{
    PyObject *k = PN_GET(node, key);
    Py_ssize_t n = k == NULL ? -1 : PyObject_Size(k);
    Py_XDECREF(k);
    return n;
}

/* `v == 0` as Python has it (a count): 1, 0, or -1 with the error set; an exact int without
 * a call. */
static int
py_eq_zero(PyObject *v)
{
    if (PyLong_CheckExact(v)) {
        int ovf;
        long long x = PyLong_AsLongLongAndOverflow(v, &ovf);
        return !ovf && x == 0;
    }
    return PyObject_RichCompareBool(v, s_zero, Py_EQ);
}

/* `o.name == 0` (off as for pyfield_get): 1, 0, or -1. */
static int
pyfield_eq_zero(PyObject *o, Py_ssize_t off, PyObject *name)
{
    PyObject *v = pyfield_get(o, off, name);
    if (v == NULL)
        return -1;
    int r = py_eq_zero(v);
    Py_DECREF(v);
    return r;
}

#define PN_ZERO(o, f) pyfield_eq_zero((o), PN_OFF((o), PN_##f), s_##f)

/* v as a C long long where it is exactly an int that fits: 1, else 0 (no error set). */
static inline int
exact_ll(PyObject *v, long long *out)
{
    if (v == NULL || !PyLong_CheckExact(v))
        return 0;
    int ovf;
    long long x = PyLong_AsLongLongAndOverflow(v, &ovf);
    if (ovf)
        return 0;
    *out = x;
    return 1;
}

/* An attribute a C path takes only as an exact int that fits (a cache's or component's
 * counter, a window): 1 (*out set); 0 to decline, no error set (not such an int, or missing:
 * the Python path meets the AttributeError where it reads it); -1 with any other error. */
static int
attr_ll(PyObject *o, PyObject *name, long long *out)
{
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    int ok = exact_ll(v, out);
    Py_DECREF(v);
    return ok;
}

/* `node.lock_ref == 0 and node.aux_lock == 0 and node.dev_children == 0` (fast/one_aux.py's
 * leaf push test: unlocked, no device children), read as far as Python's `and` reads: 1, 0,
 * or -1. */
static int
pn_unlocked_leaf(PyObject *node)
{
    int r = PN_ZERO(node, lock_ref);
    if (r > 0)
        r = PN_ZERO(node, aux_lock);
    if (r > 0)
        r = PN_ZERO(node, dev_children);
    return r;
}

/* heappush(heap, (stamp, node)) on a heap that is a list (heap_push: heapq's steps); 0 or
 * -1. */
static int
pn_heap_push(PyObject *heap, PyObject *stamp, PyObject *node)
{
    PyObject *entry = PyTuple_Pack(2, stamp, node);
    if (entry == NULL)
        return -1;
    int r = heap_push(heap, entry);
    Py_DECREF(entry);
    return r;
}

/* `o.name += d` (off as for pyfield_get; a cache's or component's counter: 0), Python's
 * in-place add, 0 or -1.  Also while an error is pending, which stays the one raised (the
 * clock paths move their counters once, on the way out of a failed call too: what was done
 * stays counted); d 0 is no step (the Python path's loop took none, so reads nothing). */
static int
pyfield_add(PyObject *o, Py_ssize_t off, PyObject *name, long long d)
{
    if (d == 0)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *v = pyfield_get(o, off, name), *dv = NULL, *sum = NULL;
    int r = -1;
    if (v != NULL && (dv = PyLong_FromLongLong(d)) != NULL
            && (sum = PyNumber_InPlaceAdd(v, dv)) != NULL)
        r = pyfield_set(o, off, name, sum);
    Py_XDECREF(v);
    Py_XDECREF(dv);
    Py_XDECREF(sum);
    return keep_error(et, ev, tb, r);
}

/* ------------------------------------------------------------------------------------------ */
/* composed tree: clock                                                                        */
/* ------------------------------------------------------------------------------------------ */
/*
 * fast/one_aux.py's lock paths for the composed tree with one aux component (SWA or Mamba, no
 * host tier): clock_inc is inc_lock_one, clock_dec is dec_lock_one, the same steps in the same
 * order with the same results (counts, boundary marks, skip sets, heap entries and their order
 * in the list, counters, errors).  The Python functions stay the reference; these return None
 * (having changed nothing) for anything they do not handle, and the Python function runs.
 *
 * Why a call either runs whole or declines: each first walks the path and reads every field it
 * will touch (nodes and records of exactly the registered classes, set slots, counts that are
 * plain ints, keys that are arrays or lists, skip sets that are sets); only then does it write.
 * The component's and the cache's counters, the next boundary mark and the split epoch are
 * ordinary attributes, read where the Python path reads them and moved once by the sum of its
 * steps (pyfield_add): reading them up front would cost more than the walk on a short path.
 * The comparisons it makes on the heap are those heapq makes; entries of the usual shape (an int
 * stamp, a Node) are compared in C as tuple and Node.__lt__ compare them (stamp, then id).
 */

static PyObject *g_ck_inc_result, *g_ck_dec_result, *g_ck_dec_params, *g_ck_not_found,
    *g_ck_handle_error, *g_ck_swa_id, *g_ck_mamba_id, *g_ck_epoch_key;
static PyObject *s_ck_one_aux, *s_ck_window, *s_ck_i, *s_ck_next_boundary, *s_ck_split_epoch,
    *s_ck_swa_uuid;

/* A node's int field that the checks found plain (no error possible). */
static inline long long
ck_field(PyObject *o, Py_ssize_t off)
{
    return PyLong_AsLongLong(SLOT_AT(o, off));
}

static int ck_rec_ok(PyObject *n, Py_ssize_t rec_at, int splits);

/* Whether node n is a Node whose fields the lock walks read are set and plain: parent, key (an
 * array or list: its length is Py_SIZE), value, lock_ref, aux_lock, dev_children,
 * last_access_time, id (ints); with rec_at >= 0 its record aux[rec_at] too (ck_rec_ok). */
static int
ck_node_ok(PyObject *n, Py_ssize_t rec_at, int splits)
{
    long long x;
    if (!PN_IS(n) || SLOT_AT(n, PN_parent) == NULL || SLOT_AT(n, PN_value) == NULL)
        return 0;
    PyObject *key = SLOT_AT(n, PN_key);
    if (key == NULL || !(PyList_CheckExact(key) || (g_array != NULL
                                                    && Py_TYPE(key) == (PyTypeObject *)g_array)))
        return 0;
    if (!exact_ll(SLOT_AT(n, PN_lock_ref), &x) || !exact_ll(SLOT_AT(n, PN_aux_lock), &x)
            || !exact_ll(SLOT_AT(n, PN_dev_children), &x)
            || !exact_ll(SLOT_AT(n, PN_last_access_time), &x)
            || !exact_ll(SLOT_AT(n, PN_id), &x))
        return 0;
    return rec_at < 0 || ck_rec_ok(n, rec_at, splits);
}

/* Whether the Node n (ck_node_ok's fields checked) has a record aux[rec_at] the lock walks can
 * read: an AuxData with value, lock (int) and boundary (None or int) set, and with splits its
 * split_from (a tuple of (int, int) pairs). */
static int
ck_rec_ok(PyObject *n, Py_ssize_t rec_at, int splits)
{
    long long x;
    PyObject *aux = SLOT_AT(n, PN_aux);
    if (aux == NULL || !PyTuple_CheckExact(aux) || PyTuple_GET_SIZE(aux) <= rec_at)
        return 0;
    PyObject *rec = PyTuple_GET_ITEM(aux, rec_at);
    if (!AD_IS(rec) || SLOT_AT(rec, AD_value) == NULL || !exact_ll(SLOT_AT(rec, AD_lock), &x))
        return 0;
    PyObject *b = SLOT_AT(rec, AD_boundary);
    if (b == NULL || (b != Py_None && !exact_ll(b, &x)))
        return 0;
    if (splits) {
        PyObject *sf = SLOT_AT(rec, AD_split_from);
        if (sf == NULL || !PyTuple_CheckExact(sf))
            return 0;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(sf); j++) {
            PyObject *p = PyTuple_GET_ITEM(sf, j);
            if (!PyTuple_CheckExact(p) || PyTuple_GET_SIZE(p) != 2
                    || !exact_ll(PyTuple_GET_ITEM(p, 0), &x)
                    || !exact_ll(PyTuple_GET_ITEM(p, 1), &x))
                return 0;
        }
    }
    return 1;
}

/* one_aux._push_unlocked: node (unlocked now) on the heap, twice when both its counts reached
 * 0, if it is an evictable leaf. */
static int
ck_push_unlocked(PyObject *heap, PyObject *node, int twice)
{
    if (ck_field(node, PN_lock_ref) != 0 || ck_field(node, PN_aux_lock) != 0
            || ck_field(node, PN_dev_children) != 0 || SLOT_AT(node, PN_value) == Py_None)
        return 0;
    PyObject *entry = PyTuple_Pack(2, SLOT_AT(node, PN_last_access_time), node);
    if (entry == NULL)
        return -1;
    int r = heap_push(heap, entry);
    if (r == 0 && twice)
        r = heap_push(heap, entry);
    Py_DECREF(entry);
    return r;
}

/* A call declined after reads that may have raised: -1 for an error other than a missing
 * attribute (the Python path meets that one where it reads it), else 0, no error set. */
static int
ck_decline(void)
{
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_AttributeError))
        return -1;
    PyErr_Clear();
    return 0;
}

/* What every lock call checks first, in the Python paths' order: the root, the node (a Node
 * in the tree: NodeNotFound otherwise), the cache not disabled.  1: go on (*root a new
 * reference), 0: decline, -1: error raised. */
static int
ck_enter(PyObject *cache, PyObject *node, PyObject **root)
{
    *root = NULL;
    if (g_ck_inc_result == NULL || g_pn_type == NULL || !PN_IS(node))
        return 0;
    PyObject *r = PyObject_GetAttr(cache, s_root_node);
    if (r == NULL)
        return -1;
    if (!PN_IS(r) || SLOT_AT(node, PN_parent) == NULL) {
        Py_DECREF(r);
        return 0;
    }
    if (node != r && SLOT_AT(node, PN_parent) == Py_None) {
        Py_DECREF(r);
        PyErr_SetString(g_ck_not_found, "the node is not in the tree");
        return -1;
    }
    PyObject *d = PyObject_GetAttr(cache, s_disable);
    int ok = d == Py_False;
    Py_XDECREF(d);
    if (!ok) {
        Py_DECREF(r);
        return ck_decline();
    }
    *root = r;
    return 1;
}

/* ck_enter, then the cache's one component.  1: go on (*root and *comp new references,
 * *is_swa), 0: decline, -1: error raised. */
static int
ck_begin(PyObject *cache, PyObject *node, PyObject **root, PyObject **comp, int *is_swa,
         PyObject **comp_id)
{
    *comp = *comp_id = NULL;
    int e = ck_enter(cache, node, root);
    if (e <= 0)
        return e;
    PyObject *r = *root, *one = PyObject_GetAttr(cache, s_ck_one_aux);
    int ok = one != NULL && PyTuple_CheckExact(one)
        && PyTuple_GET_SIZE(one) == 3 && (PyTuple_GET_ITEM(one, 1) == Py_True
                                          || PyTuple_GET_ITEM(one, 1) == Py_False);
    if (!ok) {
        Py_XDECREF(one);
        Py_DECREF(r);
        *root = NULL;
        return ck_decline();
    }
    *comp = Py_NewRef(PyTuple_GET_ITEM(one, 0));
    *is_swa = PyTuple_GET_ITEM(one, 1) == Py_True;
    *comp_id = Py_NewRef(PyTuple_GET_ITEM(one, 2));
    Py_DECREF(one);
    return 1;
}

/* Store x in an int slot; -1 when the int cannot be made. */
#define CK_SET(o, off, x) do { if (pyslot_set_ll((o), (off), (x)) < 0) goto done; } while (0)
#define CK_SET_R(o, off, x) do { if (pyslot_set_ll((o), (off), (x)) < 0) return -1; } while (0)

/* One aux component's lock in progress (the SWA window or a Mamba state): its records' index,
 * the window and what the window holds so far, its units moved evictable -> protected, the
 * ids it skipped, the split epoch it saw (SWA) and the mark where the window filled up (the
 * last three new references or NULL). */
typedef struct {
    PyObject *comp;
    Py_ssize_t ai;
    long long window, size, moved;
    PyObject *skipped, *epoch, *uuid;
} CkWindow;

static void
ck_window_clear(CkWindow *w)
{
    Py_CLEAR(w->skipped);
    Py_CLEAR(w->epoch);
    Py_CLEAR(w->uuid);
}

/* A node's id into the lock's skip set; 0 or -1. */
static int
ck_skip(CkWindow *w, PyObject *n)
{
    if (w->skipped == NULL && (w->skipped = PySet_New(NULL)) == NULL)
        return -1;
    return PySet_Add(w->skipped, SLOT_AT(n, PN_id));
}

/* lock_window's step on node cur (k units, the window not full yet): a tombstone skipped and
 * remembered (with the split epoch), else its SWA lock taken, the window's end marked where it
 * fills up.  0 or -1. */
static int
ck_window_step(CkWindow *w, PyObject *cur, long long k)
{
    PyObject *rec = PyTuple_GET_ITEM(SLOT_AT(cur, PN_aux), w->ai);
    long long x;
    if (SLOT_AT(rec, AD_value) == Py_None) {
        if (ck_skip(w, cur) < 0)
            return -1;
        if (w->epoch == NULL && (w->epoch = PyObject_GetAttr(w->comp, s_ck_split_epoch)) == NULL)
            return -1;
        return 0;
    }
    x = ck_field(rec, AD_lock);
    if (x == 0)
        w->moved += k;
    CK_SET_R(rec, AD_lock, x + 1);
    CK_SET_R(cur, PN_aux_lock, ck_field(cur, PN_aux_lock) + 1);
    w->size += k;
    if (w->size >= w->window) {
        if (SLOT_AT(rec, AD_boundary) == Py_None) {  /* the next mark, taken */
            PyObject *nb = PyObject_GetAttr(w->comp, s_ck_next_boundary);
            if (nb == NULL)
                return -1;
            pyslot_set(rec, AD_boundary, nb);
            Py_DECREF(nb);
            if (pyfield_add(w->comp, 0, s_ck_next_boundary, 1) < 0)
                return -1;
        }
        Py_XSETREF(w->uuid, Py_NewRef(SLOT_AT(rec, AD_boundary)));
    }
    return 0;
}

/* _inc_lock_py's Full walk (lock_walk) from node (its Full data set: nothing skipped) up to
 * root, the units it newly locked added to *delta.  0 or -1. */
static int
ck_full_lock(PyObject *node, PyObject *root, long long *delta)
{
    for (PyObject *cur = node; cur != root; cur = SLOT_AT(cur, PN_parent)) {
        long long x = ck_field(cur, PN_lock_ref);
        if (x == 0)
            *delta += Py_SIZE(SLOT_AT(cur, PN_key));
        CK_SET_R(cur, PN_lock_ref, x + 1);
    }
    return 0;
}

/* The Mamba lock of node (not the root, its record checked): its state locked, or the node
 * skipped and remembered where it has none.  0 or -1. */
static int
ck_mamba_lock(CkWindow *w, PyObject *node)
{
    PyObject *rec = PyTuple_GET_ITEM(SLOT_AT(node, PN_aux), w->ai);
    if (SLOT_AT(rec, AD_value) == Py_None)
        return ck_skip(w, node);
    long long x = ck_field(rec, AD_lock);
    if (x == 0)
        w->moved += 1;
    CK_SET_R(rec, AD_lock, x + 1);
    CK_SET_R(node, PN_aux_lock, ck_field(node, PN_aux_lock) + 1);
    return 0;
}

/* The lock's skips into the result's dict as the component's lock adds them: SWA's ids and
 * {-1 - the split epoch}, Mamba's ids.  0 or -1. */
static int
ck_add_skips(PyObject *skips, CkWindow *w, int is_swa)
{
    if (w->skipped == NULL)
        return 0;
    if (PyDict_SetItem(skips, is_swa ? g_ck_swa_id : g_ck_mamba_id, w->skipped) < 0)
        return -1;
    if (!is_swa)
        return 0;
    PyObject *m1 = PyLong_FromLong(-1), *e = NULL, *es = NULL;
    if (m1 != NULL)
        e = PyNumber_Subtract(m1, w->epoch);
    Py_XDECREF(m1);
    int r = e == NULL || (es = PySet_New(NULL)) == NULL || PySet_Add(es, e) < 0
        || PyDict_SetItem(skips, g_ck_epoch_key, es) < 0 ? -1 : 0;
    Py_XDECREF(e);
    Py_XDECREF(es);
    return r;
}

/* An unlock's end: the cache's counters moved by delta (also after a failed write: what was
 * done stays counted), then DecLockRefResult(delta); NULL with an error (or failed). */
static PyObject *
ck_dec_result(PyObject *cache, long long delta, int failed)
{
    pyfield_add(cache, 0, s_evictable, delta);
    if (pyfield_add(cache, 0, s_protected, -delta) < 0 || failed)
        return NULL;
    PyObject *d = PyLong_FromLongLong(delta);
    if (d == NULL)
        return NULL;
    PyObject *out = PyObject_Vectorcall(g_ck_dec_result, &d, 1, NULL);
    Py_DECREF(d);
    return out;
}

/* IncLockRefResult(delta, uuid (NULL: None), None, skips). */
static PyObject *
ck_inc_result(long long delta, PyObject *uuid, PyObject *skips)
{
    PyObject *d = PyLong_FromLongLong(delta);
    if (d == NULL)
        return NULL;
    PyObject *a[4] = {d, uuid != NULL ? uuid : Py_None, Py_None, skips};
    PyObject *out = PyObject_Vectorcall(g_ck_inc_result, a, 4, NULL);
    Py_DECREF(d);
    return out;
}

/* clock_inc(cache, node) -> one_aux.inc_lock_one's IncLockRefResult, or None. */
static PyObject *
core_clock_inc(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(2, "clock_inc(cache, node)");
    PyObject *cache = args[0], *node = args[1], *root, *comp, *comp_id;
    int is_swa;
    int r = ck_begin(cache, node, &root, &comp, &is_swa, &comp_id);
    if (r <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *out = NULL, *skips = NULL;
    long long window = 0, ai = 0, x;
    /* every read the walk needs to decide, before any write (the counters and marks it moves
     * are read where the Python path reads them: see pyfield_add) */
    int ok = 1;
    if (is_swa)
        ok = (r = attr_ll(comp, s_ck_window, &window)) > 0
            && (r = attr_ll(comp, s_ck_i, &ai)) > 0 && ai >= 0;
    if (ok) {
        PyObject *cur = node;
        while (ok && cur != root) {
            /* SWA: each node's record aux[i]; Mamba: the node's own aux[0] only */
            ok = ck_node_ok(cur, is_swa ? (Py_ssize_t)ai : (cur == node ? 0 : -1), 0);
            if (ok)
                cur = SLOT_AT(cur, PN_parent);
        }
        /* (Mamba: a node without Full data starts _inc_lock_py's skipped segment) */
        if (ok && !is_swa && node != root && SLOT_AT(node, PN_value) == Py_None)
            ok = 0;
    }
    if (!ok) {
        Py_DECREF(root);
        Py_DECREF(comp);
        Py_DECREF(comp_id);
        return r < 0 ? NULL : Py_NewRef(Py_None);
    }
    /* w.moved: comp's units evictable -> protected */
    CkWindow w = {comp, (Py_ssize_t)ai, window, 0, 0, NULL, NULL, NULL};
    long long delta = 0;
    PyObject *cur = node;
    int failed = 1;
    if (is_swa) {  /* lock_window(comp, node, result, root, True) */
        for (; cur != root; cur = SLOT_AT(cur, PN_parent)) {
            long long k = Py_SIZE(SLOT_AT(cur, PN_key));
            x = ck_field(cur, PN_lock_ref);
            if (x == 0)
                delta += k;
            CK_SET(cur, PN_lock_ref, x + 1);
            if (w.size < window && ck_window_step(&w, cur, k) < 0)
                goto done;
        }
    } else {
        if (ck_full_lock(node, root, &delta) < 0
                || (node != root && ck_mamba_lock(&w, node) < 0))
            goto done;
    }
    failed = 0;
done:
    /* the counters, moved once, also after a failed write (what was done stays counted) */
    pyfield_add(comp, 0, s_comp_evictable, -w.moved);
    pyfield_add(comp, 0, s_comp_protected, w.moved);
    pyfield_add(cache, 0, s_evictable, -delta);
    if (pyfield_add(cache, 0, s_protected, delta) < 0 || failed)
        goto out;
    if ((skips = PyDict_New()) == NULL || ck_add_skips(skips, &w, is_swa) < 0)
        goto out;
    out = ck_inc_result(delta, w.uuid, skips);
out:
    Py_XDECREF(skips);
    ck_window_clear(&w);
    Py_DECREF(root);
    Py_DECREF(comp);
    Py_DECREF(comp_id);
    return out;
}

/* A skip set of params: NULL (none), or a set; 0 to decline anything else. */
static int
ck_skip_set(PyObject *skips, PyObject *key, PyObject **out)
{
    *out = NULL;
    PyObject *s = PyDict_GetItemWithError(skips, key);  /* borrowed; ints: no error */
    if (s == NULL)
        return PyErr_Occurred() ? -1 : 1;
    if (!PyAnySet_CheckExact(s))
        return 0;
    if (PySet_GET_SIZE(s) > 0)
        *out = s;
    return 1;
}

/* id in s (s NULL: empty); the ids are plain ints, so this cannot fail. */
static inline int
ck_in(PyObject *s, PyObject *id)
{
    return s != NULL && PySet_Contains(s, id) > 0;
}

/* The SWA unlock's seen = -1 - min(skips.get(SWA_SPLIT_EPOCH, (0,))) where its skip set is not
 * empty: 1 (*seen set), 0 to decline (not a non-empty set of ints), -1 with an error. */
static int
ck_seen(PyObject *skips, long long *seen)
{
    PyObject *es = PyDict_GetItemWithError(skips, g_ck_epoch_key);
    long long lo = 0, x;
    if (es == NULL) {
        *seen = -1;
        return PyErr_Occurred() ? -1 : 1;
    }
    if (!PyAnySet_CheckExact(es) || PySet_GET_SIZE(es) == 0)
        return 0;
    PyObject *it = PyObject_GetIter(es), *e;
    if (it == NULL)
        return -1;
    int ok = 1, first = 1;
    while (ok && (e = PyIter_Next(it)) != NULL) {
        ok = exact_ll(e, &x);
        Py_DECREF(e);
        if (ok && (first || x < lo))
            lo = x;
        first = 0;
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return -1;
    *seen = -1 - lo;
    return ok;
}

/* An unlock's params (None, or exactly a DecLockRefParams; else 0: decline) read as the
 * unlocks read them: its skip dict (*skips, a new reference, NULL for None), the skip sets
 * under keys[0..n) (sets[j] borrowed: NULL for none or empty); with swa_at >= 0 (the SWA skip
 * set's index) its swa_uuid_for_lock (*uuid a new reference to an int, NULL for None) and,
 * where that set is not empty, the split epoch the lock saw (*seen).  1, 0 or -1. */
static int
ck_params(PyObject *params, PyObject *const *keys, PyObject **sets, int n, int swa_at,
          PyObject **skips, PyObject **uuid, long long *seen)
{
    long long x;
    int r = 1;
    *skips = *uuid = NULL;
    for (int j = 0; j < n; j++)
        sets[j] = NULL;
    if (params == Py_None)
        return 1;
    if ((PyObject *)Py_TYPE(params) != g_ck_dec_params)
        return 0;
    *skips = PyObject_GetAttr(params, s_skip);
    if (*skips == NULL || !PyDict_CheckExact(*skips))
        return ck_decline();
    for (int j = 0; r > 0 && j < n; j++)
        r = ck_skip_set(*skips, keys[j], &sets[j]);
    if (r <= 0 || swa_at < 0)
        return r;
    PyObject *b = PyObject_GetAttr(params, s_ck_swa_uuid);
    if (b == NULL || (b != Py_None && !exact_ll(b, &x))) {
        Py_XDECREF(b);
        return ck_decline();
    }
    if (b != Py_None)
        *uuid = b;
    else
        Py_DECREF(b);
    return sets[swa_at] == NULL ? 1 : ck_seen(*skips, seen);
}

/* cache._heap where it is a list (*heap a new reference): 1, 0 or -1. */
static int
ck_heap(PyObject *cache, PyObject **heap)
{
    *heap = PyObject_GetAttr(cache, s_heap);
    if (*heap != NULL && PyList_CheckExact(*heap))
        return 1;
    Py_CLEAR(*heap);
    return ck_decline();
}

/* _dec_full_lock's check walk (every Full count not in skip, before any change), reading every
 * field the unlock will: node with its record node_rec, its ancestors with path_rec (-1: none;
 * splits: their split_from too).  1 (*depth: the nodes below root, if not NULL), 0 to
 * decline, -1 with HandleError raised. */
static int
ck_check_unlock(PyObject *node, PyObject *root, Py_ssize_t node_rec, Py_ssize_t path_rec,
                int splits, PyObject *skip, Py_ssize_t *depth)
{
    Py_ssize_t d = 0;
    for (PyObject *cur = node; cur != root; cur = SLOT_AT(cur, PN_parent), d++) {
        if (!ck_node_ok(cur, cur == node ? node_rec : path_rec, splits))
            return 0;
        if (ck_field(cur, PN_lock_ref) <= 0 && !ck_in(skip, SLOT_AT(cur, PN_id))) {
            PyErr_SetString(g_ck_handle_error,
                            "dec_lock_ref: this path is not locked (released twice?)");
            return -1;
        }
    }
    if (depth != NULL)
        *depth = d;
    return 1;
}

/* split_off_skipped(rec, skip, seen) (rec's split_from checked: (int, int) pairs). */
static int
ck_split_off(PyObject *rec, PyObject *skip, long long seen)
{
    PyObject *sf = SLOT_AT(rec, AD_split_from);
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(sf); j++) {
        PyObject *p = PyTuple_GET_ITEM(sf, j);
        if (PyLong_AsLongLong(PyTuple_GET_ITEM(p, 0)) > seen && ck_in(skip, PyTuple_GET_ITEM(p, 1)))
            return 1;
    }
    return 0;
}

/* clock_dec(cache, node, params) -> one_aux.dec_lock_one's DecLockRefResult, or None. */
static PyObject *
core_clock_dec(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(3, "clock_dec(cache, node, params)");
    PyObject *cache = args[0], *node = args[1], *params = args[2], *root, *comp, *comp_id;
    int is_swa;
    int r = ck_begin(cache, node, &root, &comp, &is_swa, &comp_id);
    if (r <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *out = NULL, *skips = NULL, *heap = NULL, *owned = NULL;  /* (owned: the mark) */
    PyObject *keys[2] = {s_zero, comp_id}, *sets[2];  /* the Full and the component's skips */
    long long seen = 0, x;
    int ok = (r = ck_params(params, keys, sets, 2, is_swa ? 1 : -1, &skips, &owned, &seen)) > 0;
    PyObject *skip = sets[0], *cskip = sets[1], *boundary = owned != NULL ? owned : Py_None;
    if (ok)
        ok = (r = ck_heap(cache, &heap)) > 0;
    /* the Python path's check walk (every Full count, before any change), reading every field */
    if (ok)
        ok = (r = ck_check_unlock(node, root, 0, is_swa ? 0 : -1, is_swa && cskip != NULL,
                                  skip, NULL)) > 0;
    PyObject *cur;
    if (!ok) {
        if (r < 0 || (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_AttributeError)))
            r = -1;
        else
            PyErr_Clear();
        goto out;
    }
    long long moved = 0, delta = 0;  /* moved: comp's units protected -> evictable */
    int failed = 1;
    cur = node;
    if (is_swa) {  /* up to the window's end mark: Full and SWA */
        while (cur != root) {
            int full0 = 0, swa0 = 0, end = 0;
            PyObject *id = SLOT_AT(cur, PN_id);
            if (!ck_in(skip, id)) {
                x = ck_field(cur, PN_lock_ref) - 1;
                CK_SET(cur, PN_lock_ref, x);
                if (x == 0) {
                    delta += Py_SIZE(SLOT_AT(cur, PN_key));
                    full0 = 1;
                }
            }
            PyObject *rec = PyTuple_GET_ITEM(SLOT_AT(cur, PN_aux), 0);
            x = ck_field(rec, AD_lock);
            if (x != 0 && !ck_in(cskip, id) && !(cskip != NULL && ck_split_off(rec, cskip, seen))) {
                if (x == 1) {
                    moved += Py_SIZE(SLOT_AT(cur, PN_key));
                    swa0 = 1;
                }
                CK_SET(rec, AD_lock, x - 1);
                CK_SET(cur, PN_aux_lock, ck_field(cur, PN_aux_lock) - 1);
                PyObject *b = SLOT_AT(rec, AD_boundary);
                end = b != Py_None && boundary != Py_None
                    && PyLong_AsLongLong(b) == PyLong_AsLongLong(boundary);
            }
            if ((full0 || swa0) && ck_push_unlocked(heap, cur, full0 && swa0) < 0)
                goto done;
            cur = SLOT_AT(cur, PN_parent);
            if (end)
                break;
        }
    } else if (node != root) {  /* the node: Full and its state */
        int full0 = 0, m0 = 0;
        PyObject *id = SLOT_AT(node, PN_id);
        if (!ck_in(skip, id)) {
            x = ck_field(node, PN_lock_ref) - 1;
            CK_SET(node, PN_lock_ref, x);
            if (x == 0) {
                delta = Py_SIZE(SLOT_AT(node, PN_key));
                full0 = 1;
            }
        }
        PyObject *rec = PyTuple_GET_ITEM(SLOT_AT(node, PN_aux), 0);
        x = ck_field(rec, AD_lock);
        if (x > 0 && !ck_in(cskip, id)) {
            if (x == 1) {
                moved += 1;
                m0 = 1;
            }
            CK_SET(rec, AD_lock, x - 1);
            CK_SET(node, PN_aux_lock, ck_field(node, PN_aux_lock) - 1);
        }
        if ((full0 || m0) && ck_push_unlocked(heap, node, full0 && m0) < 0)
            goto done;
        cur = SLOT_AT(node, PN_parent);
    }
    for (; cur != root; cur = SLOT_AT(cur, PN_parent)) {  /* the rest of the path: Full only */
        if (ck_in(skip, SLOT_AT(cur, PN_id)))
            continue;
        x = ck_field(cur, PN_lock_ref) - 1;
        CK_SET(cur, PN_lock_ref, x);
        if (x != 0)
            continue;
        delta += Py_SIZE(SLOT_AT(cur, PN_key));
        if (ck_field(cur, PN_aux_lock) == 0 && ck_field(cur, PN_dev_children) == 0
                && SLOT_AT(cur, PN_value) != Py_None) {
            if (pn_heap_push(heap, SLOT_AT(cur, PN_last_access_time), cur) < 0)
                goto done;
        }
    }
    failed = 0;
done:
    /* the counters, moved once, also after a failed write (what was done stays counted) */
    pyfield_add(comp, 0, s_comp_evictable, moved);
    pyfield_add(comp, 0, s_comp_protected, -moved);
    if ((out = ck_dec_result(cache, delta, failed)) == NULL)
        r = -1;
out:
    Py_XDECREF(owned);
    Py_XDECREF(skips);
    Py_XDECREF(heap);
    Py_DECREF(root);
    Py_DECREF(comp);
    Py_DECREF(comp_id);
    if (out == NULL && r >= 0)
        return Py_NewRef(Py_None);
    return out;
}

#undef CK_SET

/* setup_clock(IncLockRefResult, DecLockRefResult, DecLockRefParams, NodeNotFound, HandleError,
 * SWA_ID, MAMBA_ID, SWA_SPLIT_EPOCH): the classes and skip-dict keys the lock paths use. */
static PyObject *
core_setup_clock(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(8, "setup_clock(IncLockRefResult, DecLockRefResult, "
         "DecLockRefParams, NodeNotFound, HandleError, SWA_ID, MAMBA_ID, "
         "SWA_SPLIT_EPOCH)");
    for (int i = 0; i < 5; i++)
        if (!PyType_Check(args[i])) {
            PyErr_SetString(PyExc_TypeError, "setup_clock: the first five are classes");
            return NULL;
        }
    for (int i = 5; i < 8; i++)
        if (!PyLong_CheckExact(args[i])) {
            PyErr_SetString(PyExc_TypeError, "setup_clock: the skip keys are ints");
            return NULL;
        }
    PyObject **dst[8] = {&g_ck_inc_result, &g_ck_dec_result, &g_ck_dec_params, &g_ck_not_found,
                         &g_ck_handle_error, &g_ck_swa_id, &g_ck_mamba_id, &g_ck_epoch_key};
    for (int i = 0; i < 8; i++)
        Py_XSETREF(*dst[i], Py_NewRef(args[i]));
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------ */
/* composed tree: pair locks                                                                   */
/* ------------------------------------------------------------------------------------------ */
/*
 * fast/hybrid.py inc_lock_ref / dec_lock_ref on their general path for the stock SWA and Mamba
 * plug-ins together without a host tier (the cache's _pair), the same steps in the same order
 * with the same results, counters, marks, errors and heap entries.  pair_inc: _check_attached,
 * _inc_lock_py (nothing skipped: a node without Full data is declined), then each component's
 * lock as cache.components orders them (SwaComponent.lock: lock_window without the Full walk;
 * MambaComponent.lock).  pair_dec: _check_attached, _dec_full_lock, each component's unlock in
 * that order (SwaComponent.unlock, MambaComponent.unlock), then _push_if_leaf of every node on
 * the unlocked list in its order (Full's, node to root, then each component's), after every
 * count is undone.  The rules and the steps are the clock section's (its helpers): every read
 * checked before the first write, the counters moved once at the end, None (having changed
 * nothing) for anything else, and the general path runs.  tests/fast/test_pair_locks.py runs
 * these against the general path.
 */

static PyObject *s_cm_pair, *s_cm_components;  /* (tentative definitions: cmatch interns them) */

/* ck_enter, then the pair: cache._pair's indices (SWA's, Mamba's) into cache.components (a
 * tuple or list of the two); w[0] (SWA) and w[1] (Mamba) get their component (a new reference) and its
 * records' index (its i), *swa_first their order.  1: go on (*root a new reference), 0:
 * decline, -1: error raised. */
static int
pl_begin(PyObject *cache, PyObject *node, PyObject **root, CkWindow *w, int *swa_first)
{
    memset(w, 0, 2 * sizeof(CkWindow));
    int e = ck_enter(cache, node, root);
    if (e <= 0)
        return e;
    PyObject *po = PyObject_GetAttr(cache, s_cm_pair), *comps = NULL;
    long long ai = -1, bi = -1;
    int ok = po != NULL && PyTuple_CheckExact(po) && PyTuple_GET_SIZE(po) == 3
        && exact_ll(PyTuple_GET_ITEM(po, 0), &ai) && exact_ll(PyTuple_GET_ITEM(po, 2), &bi)
        && (ai == 0 || ai == 1) && bi == 1 - ai
        && (comps = PyObject_GetAttr(cache, s_cm_components)) != NULL
        && (PyTuple_CheckExact(comps) || PyList_CheckExact(comps))
        && PySequence_Fast_GET_SIZE(comps) == 2;
    if (ok) {
        w[0].comp = Py_NewRef(PySequence_Fast_GET_ITEM(comps, ai));
        w[1].comp = Py_NewRef(PySequence_Fast_GET_ITEM(comps, bi));
        *swa_first = ai == 0;
        ok = (e = attr_ll(w[0].comp, s_ck_i, &ai)) > 0 && (e = attr_ll(w[1].comp, s_ck_i, &bi)) > 0
            && ai >= 0 && bi >= 0;
        w[0].ai = (Py_ssize_t)ai;
        w[1].ai = (Py_ssize_t)bi;
    }
    Py_XDECREF(po);
    Py_XDECREF(comps);
    if (ok)
        return 1;
    Py_CLEAR(w[0].comp);
    Py_CLEAR(w[1].comp);
    Py_CLEAR(*root);
    return e < 0 ? -1 : ck_decline();
}

static void
pl_end(PyObject *root, CkWindow *w)
{
    for (int c = 0; c < 2; c++) {
        ck_window_clear(&w[c]);
        Py_XDECREF(w[c].comp);
    }
    Py_XDECREF(root);
}

/* The components' counters, moved once by what their steps moved (sign 1: a lock, units
 * evictable -> protected; -1: an unlock), also after a failed write. */
static void
pl_move(CkWindow *w, long long sign)
{
    for (int c = 0; c < 2; c++) {
        pyfield_add(w[c].comp, 0, s_comp_evictable, -sign * w[c].moved);
        pyfield_add(w[c].comp, 0, s_comp_protected, sign * w[c].moved);
    }
}

/* pair_inc(cache, node) -> inc_lock_ref's IncLockRefResult on the general path, or None. */
static PyObject *
core_pair_inc(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(2, "pair_inc(cache, node)");
    PyObject *cache = args[0], *node = args[1], *root, *out = NULL, *skips = NULL, *cur;
    CkWindow w[2];
    int swa_first;
    int r = pl_begin(cache, node, &root, w, &swa_first);
    if (r <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_None);
    /* every read the walks need, before any write: the window, the path with its SWA records,
     * the node's Full data and its Mamba record */
    int ok = (r = attr_ll(w[0].comp, s_ck_window, &w[0].window)) > 0;
    for (cur = node; ok && cur != root; ) {  /* (up only from a node found a Node) */
        ok = ck_node_ok(cur, w[0].ai, 0);
        if (ok)
            cur = SLOT_AT(cur, PN_parent);
    }
    if (ok && node != root)
        ok = SLOT_AT(node, PN_value) != Py_None && ck_rec_ok(node, w[1].ai, 0);
    if (!ok) {
        pl_end(root, w);
        return r < 0 ? NULL : Py_NewRef(Py_None);
    }
    long long delta = 0;
    int failed = 1;
    if (ck_full_lock(node, root, &delta) < 0)
        goto done;
    for (int c = 0; c < 2; c++) {
        if ((c == 0) == swa_first) {  /* SwaComponent.lock: one window above the node */
            for (cur = node; cur != root && w[0].size < w[0].window; cur = SLOT_AT(cur, PN_parent))
                if (ck_window_step(&w[0], cur, Py_SIZE(SLOT_AT(cur, PN_key))) < 0)
                    goto done;
        } else if (node != root && ck_mamba_lock(&w[1], node) < 0) {  /* MambaComponent.lock */
            goto done;
        }
    }
    failed = 0;
done:
    pl_move(w, 1);
    pyfield_add(cache, 0, s_evictable, -delta);
    if (pyfield_add(cache, 0, s_protected, delta) < 0 || failed)
        goto out;
    if ((skips = PyDict_New()) == NULL)
        goto out;
    for (int c = 0; c < 2; c++) {  /* the skips as the components' locks add them */
        int swa = (c == 0) == swa_first;
        if (ck_add_skips(skips, &w[swa ? 0 : 1], swa) < 0)
            goto out;
    }
    out = ck_inc_result(delta, w[0].uuid, skips);
out:
    Py_XDECREF(skips);
    pl_end(root, w);
    return out;
}

#define PL_SET(o, off, x) do { if (pyslot_set_ll((o), (off), (x)) < 0) goto done; } while (0)

/* pair_dec(cache, node, params) -> dec_lock_ref's DecLockRefResult on the general path, or
 * None. */
static PyObject *
core_pair_dec(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(3, "pair_dec(cache, node, params)");
    PyObject *cache = args[0], *node = args[1], *params = args[2], *root, *cur;
    CkWindow w[2];
    int swa_first;
    int r = pl_begin(cache, node, &root, w, &swa_first);
    if (r <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *out = NULL, *skips = NULL, *heap = NULL, *mark = NULL;
    PyObject *keys[3] = {s_zero, g_ck_swa_id, g_ck_mamba_id}, *sets[3];  /* Full, SWA, Mamba */
    PyObject *small[64], **unlocked = small;  /* the general path's unlocked list */
    long long seen = 0, x, boundary = 0;  /* (the mark, 0 for None: `if boundary` is false) */
    Py_ssize_t depth = 0, n = 0;
    int ok = (r = ck_params(params, keys, sets, 3, 1, &skips, &mark, &seen)) > 0;
    if (ok && mark != NULL)
        boundary = PyLong_AsLongLong(mark);
    if (ok)
        ok = (r = ck_heap(cache, &heap)) > 0;
    if (ok)  /* _dec_full_lock's check walk, reading the SWA records as well */
        ok = (r = ck_check_unlock(node, root, w[0].ai, w[0].ai, sets[1] != NULL, sets[0],
                                  &depth)) > 0;
    if (ok && node != root)
        ok = ck_rec_ok(node, w[1].ai, 0);
    if (ok && 2 * depth + 1 > (Py_ssize_t)(sizeof(small) / sizeof(small[0])))
        ok = (unlocked = PyMem_Malloc((size_t)(2 * depth + 1) * sizeof(PyObject *))) != NULL;
    if (!ok) {
        r = r < 0 ? -1 : ck_decline();
        goto out;
    }
    long long delta = 0;
    int failed = 1;
    for (cur = node; cur != root; cur = SLOT_AT(cur, PN_parent)) {  /* _dec_full_lock */
        if (ck_in(sets[0], SLOT_AT(cur, PN_id)))
            continue;
        x = ck_field(cur, PN_lock_ref) - 1;
        PL_SET(cur, PN_lock_ref, x);
        if (x == 0) {
            delta += Py_SIZE(SLOT_AT(cur, PN_key));
            unlocked[n++] = cur;
        }
    }
    for (int c = 0; c < 2; c++) {
        if ((c == 0) == swa_first) {  /* SwaComponent.unlock: up to the window's end mark */
            for (cur = node; cur != root; cur = SLOT_AT(cur, PN_parent)) {
                PyObject *rec = PyTuple_GET_ITEM(SLOT_AT(cur, PN_aux), w[0].ai);
                x = ck_field(rec, AD_lock);
                if (ck_in(sets[1], SLOT_AT(cur, PN_id)) || x == 0
                        || (sets[1] != NULL && ck_split_off(rec, sets[1], seen)))
                    continue;
                if (x == 1) {
                    w[0].moved += Py_SIZE(SLOT_AT(cur, PN_key));
                    unlocked[n++] = cur;
                }
                PL_SET(rec, AD_lock, x - 1);
                PL_SET(cur, PN_aux_lock, ck_field(cur, PN_aux_lock) - 1);
                PyObject *b = SLOT_AT(rec, AD_boundary);
                if (boundary != 0 && b != Py_None && PyLong_AsLongLong(b) == boundary)
                    break;
            }
        } else if (node != root) {  /* MambaComponent.unlock: the node's state */
            PyObject *rec = PyTuple_GET_ITEM(SLOT_AT(node, PN_aux), w[1].ai);
            x = ck_field(rec, AD_lock);
            if (!ck_in(sets[2], SLOT_AT(node, PN_id)) && x > 0) {
                if (x == 1) {
                    w[1].moved += 1;
                    unlocked[n++] = node;
                }
                PL_SET(rec, AD_lock, x - 1);
                PL_SET(node, PN_aux_lock, ck_field(node, PN_aux_lock) - 1);
            }
        }
    }
    for (Py_ssize_t j = 0; j < n; j++)  /* _push_if_leaf, once per entry, all counts undone */
        if (ck_push_unlocked(heap, unlocked[j], 0) < 0)
            goto done;
    failed = 0;
done:
    pl_move(w, -1);
    if ((out = ck_dec_result(cache, delta, failed)) == NULL)
        r = -1;
out:
    if (unlocked != small && unlocked != NULL)
        PyMem_Free(unlocked);
    Py_XDECREF(mark);
    Py_XDECREF(skips);
    Py_XDECREF(heap);
    pl_end(root, w);
    if (out == NULL && r >= 0)
        return Py_NewRef(Py_None);
    return out;
}

#undef PL_SET
#undef CK_SET_R

/* ------------------------------------------------------------------------------------------ */
/* composed tree: cmatch                                                                       */
/* ------------------------------------------------------------------------------------------ */
/*
 * one_match(cache, comp, units, extra_key, window): fast/one_aux.py match_one after its key
 * and argument checks (the composed tree with one SWA or Mamba component, no host tier, the
 * lru order), the same steps in the same order: the walk down with match_step's step (a split
 * through the cache's own _split, a Python call), the matched path's records to the front of
 * the component's LRU list and its stamps in one walk up, the matched node's leaf push, the
 * concatenation, the Mamba branching length, the MatchResult.  None, having changed nothing,
 * for what it leaves to the Python function: anything on the walk down that is not exactly a
 * Node, its AuxData and a dict of children with an array('q') key (the walk down changes
 * nothing until its last step's split).  After the split, an object of another class is read
 * and written through Python's attribute access, as the Python function would (never by
 * offset).  tests/fast/test_one_aux_c_cmatch.py runs this against the Python function.
 */

static PyObject *s_cm_components, *s_cm_window, *s_cm_cow, *s_cm_chunk, *s_cm_pair;
static PyObject *g_cm_heappush = NULL;  /* heapq.heappush: a heap that is not a list */

/* The child of an exact Node's children dict holding the page of p[pos:] (borrowed), NULL if
 * none (or with an error set): match_step's lookup, with the Full core's probe at page size
 * > 1 where it is on (the same dict answer without building the page tuple). */
static PyObject *
cm_child(PyObject *children, const long long *p, Py_ssize_t pos, Py_ssize_t ps, PyObject *ek)
{
#ifdef HAVE_PROBE
    PyObject *pc;
    if (probe_get(children, p + pos, ps, ek, &pc) != 0)  /* (NULL with the error on -1) */
        return pc;
#endif
    PyObject *ck = child_key(p, pos, ps, ek);
    if (ck == NULL)
        return NULL;
    PyObject *c = PyDict_GetItemWithError(children, ck);
    Py_DECREF(ck);
    return c;
}

/* The match after match_one's key and argument checks, over the key's units u[0:ulen]: the
 * MatchResult (new reference), Py_None (new reference: declined, nothing changed), or NULL
 * with the error set. */
static PyObject *
cm_match(PyObject *cache, PyObject *comp, Py_ssize_t ai, PyObject *comp2, Py_ssize_t bi,
         const long long *u, Py_ssize_t ulen, PyObject *ek, long long window)
{
    int ovf = 0;
    KeyView kv;
    kv.held = 0;
    PyObject *root = NULL, *disable = NULL, *node = NULL, *best = NULL, *chunks = NULL;
    PyObject *lru = NULL, *prev = NULL, *cur = NULL, *rec = NULL, *v = NULL, *heap = NULL;
    PyObject *indices = NULL, *branching = NULL, *result = NULL, *prev2 = NULL;
    int declined = 0;
    /* the records the walk reads: the windowed component's at ai and, for the pair, the
     * Mamba component's at bi (comp2); the Mamba branching length with a Mamba component */
    Py_ssize_t nrec = comp2 != NULL && bi >= ai ? bi + 1 : ai + 1;
    int mamba = window == 0 || comp2 != NULL;
    /* root = cache.root_node; ps = cache.page_size; n = whole pages of units */
    if ((root = PyObject_GetAttr(cache, s_root_node)) == NULL)
        return NULL;
    PyObject *pso = PyObject_GetAttr(cache, s_page_size);
    if (pso == NULL)
        goto done;
    long long ps = PyLong_CheckExact(pso) ? PyLong_AsLongLongAndOverflow(pso, &ovf) : 0;
    Py_DECREF(pso);
    if (!PN_IS(root) || ps < 1 || ovf) {
        declined = 1;
        goto done;
    }
    Py_ssize_t n = ulen - ulen % (Py_ssize_t)ps;
    if ((disable = PyObject_GetAttr(cache, s_disable)) == NULL)
        goto done;
    int dis = PyObject_IsTrue(disable);
    if (dis < 0)
        goto done;
    if (dis || n == 0) {
        if ((indices = PyObject_GetAttr(cache, s_empty)) == NULL)
            goto done;
        best = Py_NewRef(root);
        goto result;
    }
    /* the walk down: read only until its last step's split */
    if ((chunks = PyList_New(0)) == NULL)
        goto done;
    node = Py_NewRef(root);
    best = Py_NewRef(root);
    Py_ssize_t pos = 0, best_chunks = 0;
    long long run = 0;
    int run_inf = 1;  /* (Python's float('inf'): no tombstone met yet) */
    while (pos < n) {
        PyObject *children = SLOT_AT(node, PN_children);
        if (children == NULL || !PyDict_CheckExact(children)) {
            declined = 1;
            goto done;
        }
        PyObject *child = cm_child(children, u, pos, (Py_ssize_t)ps, ek);  /* borrowed */
        if (child == NULL) {
            if (PyErr_Occurred())
                goto done;
            break;
        }
        if (!PN_IS(child) || SLOT_AT(child, PN_value) == NULL || SLOT_AT(child, PN_key) == NULL) {
            declined = 1;
            goto done;
        }
        if (IS_NONE(SLOT_AT(child, PN_value)))
            break;
        Py_INCREF(child);
        if (key_view(SLOT_AT(child, PN_key), &kv) < 0) {  /* (EAGLE's lists: match_step_py) */
            PyErr_Clear();
            Py_DECREF(child);
            declined = 1;
            goto done;
        }
        Py_ssize_t k = kv.n;
        int split = !(pos + k <= n && memcmp(u + pos, kv.p, (size_t)k * sizeof(long long)) == 0);
        if (split)
            k = shared_pages(kv.p, kv.n, u + pos, n - pos, (Py_ssize_t)ps);
        key_release(&kv);
        if (!split) {
            /* checked before anything changes: its record is an AuxData (the Python function
             * reads the same fields; another class goes there) */
            PyObject *aux = SLOT_AT(child, PN_aux);
            int odd = aux == NULL || !PyTuple_CheckExact(aux) || PyTuple_GET_SIZE(aux) < nrec;
            for (Py_ssize_t j = 0; !odd && j < nrec; j++)
                odd = !AD_IS(PyTuple_GET_ITEM(aux, j))
                    || SLOT_AT(PyTuple_GET_ITEM(aux, j), AD_value) == NULL;
            if (odd) {
                Py_DECREF(child);
                declined = 1;
                goto done;
            }
        } else {
            /* child = cache._split(child, k): the one change of the walk down, its last step */
            PyObject *ko = PyLong_FromSsize_t(k);
            PyObject *upper = ko == NULL ? NULL
                : PyObject_CallMethodObjArgs(cache, s_split_m, child, ko, NULL);
            Py_XDECREF(ko);
            Py_DECREF(child);
            if (upper == NULL)
                goto done;
            child = upper;
        }
        /* chunks.append(child.value); node, pos = child, pos + k */
        if ((v = PN_GET(child, value)) == NULL
                || PyList_Append(chunks, v) < 0) {
            Py_DECREF(child);
            goto done;
        }
        Py_CLEAR(v);
        Py_SETREF(node, child);
        pos += k;
        /* the validator's rule: a run of component data reaching the window (the pair: and
         * a Mamba state on the node, SWA's run counted on either way) */
        if ((rec = pn_rec_at(child, ai)) == NULL)
            goto done;
        int held = rec_holds(rec);
        Py_CLEAR(rec);
        if (held < 0)
            goto done;
        if (!held) {
            run_inf = 0;
            run = 0;
        } else {
            run += k;
            int state = 1;
            if (comp2 != NULL) {
                if ((rec = pn_rec_at(child, bi)) == NULL)
                    goto done;
                state = rec_holds(rec);
                Py_CLEAR(rec);
                if (state < 0)
                    goto done;
            }
            if ((run_inf || run >= window) && state) {
                Py_INCREF(child);
                Py_SETREF(best, child);
                best_chunks = PyList_GET_SIZE(chunks);
            }
        }
        if (split)  /* the match ends inside the old node */
            break;
    }
    /* the matched path: its records to the front of the list (node first), its stamps (the
     * node newest, each ancestor one older, the root included) */
    if ((lru = PyObject_GetAttr(comp, s_lru)) == NULL
            || (prev = PyObject_GetAttr(lru, s_head)) == NULL)
        goto done;
    if (comp2 != NULL) {
        Py_SETREF(lru, PyObject_GetAttr(comp2, s_lru));
        if (lru == NULL || (prev2 = PyObject_GetAttr(lru, s_head)) == NULL)
            goto done;
    }
    long long clock;
    if (get_ll(cache, s_clock, &clock) < 0)
        goto done;
    clock += g_stride;
    if (set_ll(cache, s_clock, clock) < 0)
        goto done;
    cur = Py_NewRef(best);
    while (cur != root) {
        if ((v = PyLong_FromLongLong(clock)) == NULL
                || PN_SET(cur, last_access_time, v) < 0)
            goto done;
        Py_CLEAR(v);
        clock -= 1;
        /* each record to the front of its list, in component order */
        for (int side = 0; side < (comp2 != NULL ? 2 : 1); side++) {
            int second = comp2 != NULL && (side == 0) == (bi < ai);
            PyObject **at = second ? &prev2 : &prev;
            PyObject *r = pn_rec_at(cur, second ? bi : ai);
            if (r == NULL || rec_to_front(at, r) < 0)
                goto done;
        }
        PyObject *up = PN_GET(cur, parent);
        if (up == NULL)
            goto done;
        Py_SETREF(cur, up);
    }
    if ((v = PyLong_FromLongLong(clock)) == NULL
            || PN_SET(root, last_access_time, v) < 0)
        goto done;
    Py_CLEAR(v);
    if (best != root) {  /* (``_push_if_leaf``: it holds data, it is attached) */
        int leaf = pn_unlocked_leaf(best);
        if (leaf < 0)
            goto done;
        if (leaf) {
            if ((heap = PyObject_GetAttr(cache, s_heap)) == NULL
                    || (v = PN_GET(best, last_access_time)) == NULL)
                goto done;
            PyObject *entry = PyTuple_Pack(2, v, best);
            Py_CLEAR(v);
            if (entry == NULL)
                goto done;
            int r;
            if (PyList_CheckExact(heap)) {
                r = heap_push(heap, entry);
            } else {
                PyObject *a[2] = {heap, entry};
                r = discard(PyObject_Vectorcall(g_cm_heappush, a, 2, NULL));
            }
            Py_DECREF(entry);
            if (r < 0)
                goto done;
        }
    }
    if (best_chunks == 0) {
        if ((indices = PyObject_GetAttr(cache, s_empty)) == NULL)
            goto done;
    } else if (best_chunks == 1) {
        indices = Py_NewRef(PyList_GET_ITEM(chunks, 0));
    } else {
        PyObject *part = best_chunks == PyList_GET_SIZE(chunks) ? Py_NewRef(chunks)
            : PyList_GetSlice(chunks, 0, best_chunks);
        if (part == NULL)
            goto done;
        indices = concat_values(part, NULL);
        Py_DECREF(part);
        if (indices == NULL)
            goto done;
    }
    if (mamba && PyList_GET_SIZE(chunks) > best_chunks) {
        /* Mamba: the walk went past the state; the chunk-aligned length it reached */
        PyObject *c = PyObject_GetAttr(cache, s_cm_chunk);
        PyObject *p = c == NULL ? NULL : PyLong_FromSsize_t(pos);
        PyObject *q = p == NULL ? NULL : PyNumber_FloorDivide(p, c);
        PyObject *aligned = q == NULL ? NULL : PyNumber_Multiply(q, c);
        Py_XDECREF(c);
        Py_XDECREF(p);
        Py_XDECREF(q);
        if (aligned == NULL)
            goto done;
        int pos_ = PyObject_RichCompareBool(aligned, s_zero, Py_GT);
        if (pos_ < 0) {
            Py_DECREF(aligned);
            goto done;
        }
        if (pos_)
            branching = aligned;
        else
            Py_DECREF(aligned);
    }
result:;
    PyObject *items = PyTuple_Pack(9, indices, best, best, best, s_zero, s_zero, s_zero,
                                   branching != NULL ? branching : Py_None, Py_None);
    if (items == NULL)
        goto done;
    PyObject *targs = PyTuple_Pack(1, items);
    Py_DECREF(items);
    if (targs == NULL)
        goto done;
    result = PyTuple_Type.tp_new((PyTypeObject *)g_MatchResult, targs, NULL);
    Py_DECREF(targs);
done:
    key_release(&kv);
    Py_XDECREF(root);
    Py_XDECREF(disable);
    Py_XDECREF(node);
    Py_XDECREF(best);
    Py_XDECREF(chunks);
    Py_XDECREF(lru);
    Py_XDECREF(prev);
    Py_XDECREF(prev2);
    Py_XDECREF(cur);
    Py_XDECREF(rec);
    Py_XDECREF(v);
    Py_XDECREF(heap);
    Py_XDECREF(indices);
    Py_XDECREF(branching);
    if (declined)
        Py_RETURN_NONE;
    return result;
}

/* getattr(o, name, None) as a new reference (None where o has no such attribute); NULL with
 * any other error set. */
static PyObject *
cm_getattr_or_none(PyObject *o, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        v = Py_NewRef(Py_None);
    }
    return v;
}

/* one_match(cache, params): match_one whole where it does not decline.  The key's parts as
 * _key_parts makes them, for three shapes: uniradix's RadixKey with an array (read in place);
 * an object of sglang's RadixKey shape with an array('q') (as_radix_key keeps that array: read
 * in place); the same shape with a list of exact ints, its extra_key None or a str, its
 * is_bigram a bool (the list read into C memory once: the values array('q', ...) holds, no
 * array made).  Anything else (a
 * bigram, a token that is not an exact int or does not fit int64, another shape, an error
 * while reading) is declined: the Python function runs from its start, with its checks and
 * errors.  Then match_one's argument reads (the component, the window, a Mamba
 * copy-on-write match declined) and cm_match. */
static PyObject *cm_entry(PyObject *const *args, Py_ssize_t nargs, int pair);

static PyObject *
core_one_match(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    return cm_entry(args, nargs, 0);
}

/* pair_match(cache, params): fast/hybrid.py match_prefix's general path for the stock SWA
 * and Mamba plug-ins together (``_pair``: SWA's index, its window, Mamba's index; no host
 * tier, the lru order), where it does not decline: the same key shapes as one_match, then
 * cm_match with both records (the SWA run and the Mamba state as the general path applies
 * them inline; both lists' moves in one walk up, in component order).  A Mamba
 * copy-on-write match is declined (the plug-in's).  tests/fast/test_pair_match.py runs this
 * against the general path. */
static PyObject *
core_pair_match(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    return cm_entry(args, nargs, 1);
}

/* one_match (pair 0) and pair_match (pair 1: the two-component read): (cache, params). */
static PyObject *
cm_entry(PyObject *const *args, Py_ssize_t nargs, int pair)
{
    ARGC(2, pair ? "pair_match(cache, params)" : "one_match(cache, params)");
    PyObject *cache = args[0], *params = args[1];
    if (g_pn_type == NULL || g_MatchResult == NULL || g_RadixKey == NULL || g_array == NULL
            || g_cm_heappush == NULL)
        Py_RETURN_NONE;  /* (before setup_pynode / setup_api / one_match_setup: Python's) */
    KeyView uk;
    uk.held = 0;
    long long small[256], *owned = NULL;
    const long long *u = NULL;
    Py_ssize_t ulen = 0;
    PyObject *key = NULL, *toks = NULL, *ek = NULL, *bigram = NULL, *comps = NULL, *comp = NULL;
    PyObject *wo = NULL, *result = NULL, *comp2 = NULL, *po = NULL;
    Py_ssize_t ai = 0, bi = 0;
    if ((key = PyObject_GetAttr(params, s_key)) == NULL)
        goto decline;
    if ((PyObject *)Py_TYPE(key) == g_RadixKey) {
        if ((toks = PyObject_GetAttr(key, s_token_ids)) == NULL
                || (PyObject *)Py_TYPE(toks) != g_array || key_view(toks, &uk) < 0
                || (ek = PyObject_GetAttr(key, s_extra_key)) == NULL
                || (bigram = PyObject_GetAttr(key, s_is_bigram)) == NULL)
            goto decline;
        int b = PyObject_IsTrue(bigram);
        if (b != 0)  /* (a bigram: the general path; an error: Python's) */
            goto decline;
        u = uk.p;
        ulen = uk.n;
    } else if ((toks = cm_getattr_or_none(key, s_token_ids)) != NULL
               && (PyObject *)Py_TYPE(toks) == g_array) {
        /* (as_radix_key: the same array where its typecode is 'q'; its three attributes read
         * without defaults, the extra key None or a str, the bigram flag a bool) */
        if (key_view(toks, &uk) < 0 || uk.buf.format[0] != 'q'
                || (ek = PyObject_GetAttr(key, s_extra_key)) == NULL
                || (ek != Py_None && !PyUnicode_CheckExact(ek))
                || (bigram = PyObject_GetAttr(key, s_is_bigram)) == NULL || bigram != Py_False)
            goto decline;
        u = uk.p;
        ulen = uk.n;
    } else {
        if (toks == NULL || !PyList_CheckExact(toks)
                || (ek = cm_getattr_or_none(key, s_extra_key)) == NULL
                || (ek != Py_None && !PyUnicode_CheckExact(ek))
                || (bigram = cm_getattr_or_none(key, s_is_bigram)) == NULL
                || bigram != Py_False)
            goto decline;
        ulen = PyList_GET_SIZE(toks);
        owned = ulen <= 256 ? small : PyMem_Malloc((size_t)ulen * sizeof(long long));
        if (owned == NULL)
            goto decline;
        for (Py_ssize_t i = 0; i < ulen; i++) {
            PyObject *x = PyList_GET_ITEM(toks, i);
            int ovf;
            if (!PyLong_CheckExact(x))
                goto decline;
            owned[i] = PyLong_AsLongLongAndOverflow(x, &ovf);
            if (ovf)
                goto decline;
        }
        u = owned;
    }
    int ovf;
    long long window;
    if (!pair) {  /* comp = cache.components[0]; window = cache._inline_window */
        if ((comps = PyObject_GetAttr(cache, s_cm_components)) == NULL
                || (comp = PySequence_GetItem(comps, 0)) == NULL
                || (wo = PyObject_GetAttr(cache, s_cm_window)) == NULL
                || !PyLong_CheckExact(wo))
            goto decline;
        window = PyLong_AsLongLongAndOverflow(wo, &ovf);
        if (ovf)
            goto decline;
    } else {  /* (swa_i, window, mamba_i) = cache._pair; the two plug-ins by those indices */
        if ((po = PyObject_GetAttr(cache, s_cm_pair)) == NULL || !PyTuple_CheckExact(po)
                || PyTuple_GET_SIZE(po) != 3 || !PyLong_CheckExact(PyTuple_GET_ITEM(po, 0))
                || !PyLong_CheckExact(PyTuple_GET_ITEM(po, 1))
                || !PyLong_CheckExact(PyTuple_GET_ITEM(po, 2)))
            goto decline;
        ai = PyLong_AsSsize_t(PyTuple_GET_ITEM(po, 0));
        window = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(po, 1), &ovf);
        bi = PyLong_AsSsize_t(PyTuple_GET_ITEM(po, 2));
        if (ovf || ai < 0 || bi < 0 || ai == bi || window < 1
                || (comps = PyObject_GetAttr(cache, s_cm_components)) == NULL
                || (comp = PySequence_GetItem(comps, ai)) == NULL
                || (comp2 = PySequence_GetItem(comps, bi)) == NULL)
            goto decline;
    }
    if (window == 0 || pair) {  /* a Mamba copy-on-write match: the general path's */
        PyObject *cow = cm_getattr_or_none(params, s_cm_cow);
        int c = cow == NULL ? -1 : PyObject_IsTrue(cow);
        Py_XDECREF(cow);
        if (c != 0)
            goto decline;
    }
    result = cm_match(cache, comp, ai, comp2, bi, u, ulen, ek, window);
    goto done;
decline:
    PyErr_Clear();
    result = Py_NewRef(Py_None);
done:
    key_release(&uk);
    if (owned != NULL && owned != small)
        PyMem_Free(owned);
    Py_XDECREF(key);
    Py_XDECREF(toks);
    Py_XDECREF(ek);
    Py_XDECREF(bigram);
    Py_XDECREF(comps);
    Py_XDECREF(comp);
    Py_XDECREF(comp2);
    Py_XDECREF(po);
    Py_XDECREF(wo);
    return result;
}

/* one_match_setup(heappush): heapq.heappush, for a heap that is not a list. */
static PyObject *
core_one_match_setup(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1 || !PyCallable_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "one_match_setup(heappush)");
        return NULL;
    }
    Py_XSETREF(g_cm_heappush, Py_NewRef(args[0]));
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------ */
/* composed tree: cevict (fast/one_aux.py evict_swa and _evict_mamba, their loops in C)       */
/* ------------------------------------------------------------------------------------------ */
/*
 * An evict of the one-component composed tree (fast/one_aux.py evict_swa, _evict_mamba): the
 * oldest evictable leaves off the Full leaf heap, then the component's LRU list from its
 * oldest record, each evicted node's steps written out.  These functions are those two
 * loops, step for step: the same nodes in the same order, the same heap entries (heapq's own
 * sift steps, so the list itself is the same), the same LRU unlinks, stamps and counters, the
 * same pieces queued for the frees, the same event calls.  The frees themselves stay where
 * the Python has them (the FreeBatch's release, or native_release then fast/frees.py
 * release): these functions only fill the lists, and the caller hands them back in its
 * `finally`, also when an error stops the loops half way, as the Python does.
 *
 * The counters (cache._evictable, comp.evictable) are kept in C locals and written back once
 * at the end, on the error path too; where events are on, they are written back before each
 * events.removed(node) and read again after it, so the callback sees what it sees under the
 * Python.  A call declines (None, nothing changed) where the arguments are not what the
 * Python fast path gets (see aux_evict_prepare); anything of the tree that is not exactly a
 * Node, AuxData or LRU sentinel met half way cannot be declined any more and raises
 * TypeError (fast/hybrid.py _new_node makes only those).
 */

static PyObject *s_ce_tail, *s_ce_removed;

typedef struct {
    PyObject *cache, *comp;
    PyObject *heap;      /* cache._heap: the Full leaf heap (a list with heapq's invariant) */
    PyObject *root;      /* cache.root_node */
    PyObject *events;    /* cache._events, or NULL when None */
    int is_swa;
    PyObject *runs;      /* SWA: the FreeBatch's runs, [(method, [slots, ...]), ...] */
    PyObject *kv;        /* Mamba: the deleted leaves' Full slots */
    PyObject *states;    /* Mamba: the dropped states */
    long long cache_ev;  /* cache._evictable */
    long long comp_ev;   /* comp.evictable */
    long long full;      /* Full units evicted */
    long long units;     /* the component's units evicted */
} AuxEvict;

/* heapq's _siftdown(heap, start, pos): the item at pos moves up while it is below its parent. */
static int
ce_siftdown(PyObject *heap, Py_ssize_t start, Py_ssize_t pos)
{
    Py_ssize_t size = PyList_GET_SIZE(heap);
    while (pos > start) {
        Py_ssize_t up = (pos - 1) >> 1;
        PyObject *item = PyList_GET_ITEM(heap, pos), *parent = PyList_GET_ITEM(heap, up);
        Py_INCREF(item);
        Py_INCREF(parent);
        int lt = entry_lt(item, parent);
        Py_DECREF(parent);
        Py_DECREF(item);
        if (lt < 0)
            return -1;
        if (size != PyList_GET_SIZE(heap)) {
            PyErr_SetString(PyExc_RuntimeError, "list changed size during iteration");
            return -1;
        }
        if (!lt)
            break;
        item = PyList_GET_ITEM(heap, pos);  /* (both stay owned by the list: a swap) */
        PyList_SET_ITEM(heap, pos, PyList_GET_ITEM(heap, up));
        PyList_SET_ITEM(heap, up, item);
        pos = up;
    }
    return 0;
}

/* heapq.heappop(heap) of a non-empty list (new reference): the last item goes to the top,
 * the smaller child moves up until a leaf is reached (heapq's _siftup), then it moves back
 * up (_siftdown) -- heapq's steps, so the list is left as heapq leaves it. */
static PyObject *
ce_heappop(PyObject *heap)
{
    Py_ssize_t n = PyList_GET_SIZE(heap);
    PyObject *last = PyList_GET_ITEM(heap, n - 1);
    Py_INCREF(last);
    if (PyList_SetSlice(heap, n - 1, n, NULL) < 0) {
        Py_DECREF(last);
        return NULL;
    }
    n--;
    if (n == 0)
        return last;
    PyObject *top = PyList_GET_ITEM(heap, 0);  /* the list's reference moves to us */
    PyList_SET_ITEM(heap, 0, last);            /* and ours of `last` to the list */
    Py_ssize_t pos = 0, limit = n >> 1;
    while (pos < limit) {
        Py_ssize_t c = 2 * pos + 1;
        if (c + 1 < n) {
            PyObject *a = PyList_GET_ITEM(heap, c), *b = PyList_GET_ITEM(heap, c + 1);
            Py_INCREF(a);
            Py_INCREF(b);
            int lt = entry_lt(a, b);
            Py_DECREF(a);
            Py_DECREF(b);
            if (lt < 0)
                goto error;
            if (n != PyList_GET_SIZE(heap)) {
                PyErr_SetString(PyExc_RuntimeError, "list changed size during iteration");
                goto error;
            }
            c += !lt;
        }
        PyObject *t = PyList_GET_ITEM(heap, c);
        PyList_SET_ITEM(heap, c, PyList_GET_ITEM(heap, pos));
        PyList_SET_ITEM(heap, pos, t);
        pos = c;
    }
    if (ce_siftdown(heap, 0, pos) < 0)
        goto error;
    return top;
error:
    Py_DECREF(top);
    return NULL;
}

/* 0 where node is exactly a Node, else -1 with a TypeError: only those are read and written
 * through offsets here. */
static inline int
ce_check_node(PyObject *node)
{
    if (PN_IS(node))
        return 0;
    PyErr_Format(PyExc_TypeError, "evict: a tree node of type %.100s, not Node",
                 Py_TYPE(node)->tp_name);
    return -1;
}

/* A field of a registered node (borrowed), or NULL with an error: ce_check_node's TypeError
 * for an object that is not exactly a Node. */
static PyObject *
ce_node_field(PyObject *node, Py_ssize_t off, const char *name)
{
    return ce_check_node(node) < 0 ? NULL : pyslot_get(node, off, name);
}

/* `not v` as Python has it (1, 0, or -1 with an error); exact ints without a call. */
static inline int
ce_not(PyObject *v)
{
    if (PyLong_CheckExact(v)) {
        int ovf;
        long long x = PyLong_AsLongLongAndOverflow(v, &ovf);
        return !ovf && x == 0;
    }
    int t = PyObject_IsTrue(v);
    return t < 0 ? -1 : !t;
}

/* The evictable-leaf test of the loops, on `node`'s fields in the Python's order:
 * `stamp` NULL: `lock_ref == 0 and aux_lock == 0 and dev_children == 0 and value is not None
 * and parent is not None` (the LRU loop's); else `last_access_time == stamp and not lock_ref
 * and not aux_lock and not dev_children and ...` (_pop_leaf's).  1, 0, or -1 with an error. */
static int
ce_is_leaf(PyObject *node, PyObject *stamp)
{
    PyObject *v;
    int t;
    if (stamp != NULL) {
        if ((v = ce_node_field(node, PN_last_access_time, "last_access_time")) == NULL)
            return -1;
        if ((t = PyObject_RichCompareBool(v, stamp, Py_EQ)) <= 0)
            return t;
    }
    static const struct { Py_ssize_t *off; const char *name; } counts[3] = {
        {&PN_lock_ref, "lock_ref"}, {&PN_aux_lock, "aux_lock"}, {&PN_dev_children, "dev_children"}};
    for (int i = 0; i < 3; i++) {
        if ((v = ce_node_field(node, *counts[i].off, counts[i].name)) == NULL)
            return -1;
        if ((t = stamp != NULL ? ce_not(v) : py_eq_zero(v)) <= 0)
            return t;
    }
    if ((v = ce_node_field(node, PN_value, "value")) == NULL)
        return -1;
    if (v == Py_None)
        return 0;
    if ((v = ce_node_field(node, PN_parent, "parent")) == NULL)
        return -1;
    return v != Py_None;
}

/* _pop_leaf: the oldest live entry's node off the heap (new reference), or NULL: with an
 * error set, or none when the heap ran empty. */
static PyObject *
ce_pop_leaf(PyObject *heap)
{
    while (PyList_GET_SIZE(heap) > 0) {
        PyObject *e = ce_heappop(heap);
        if (e == NULL)
            return NULL;
        if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 2) {
            Py_DECREF(e);
            PyErr_SetString(PyExc_TypeError, "evict: a leaf heap entry that is not (stamp, node)");
            return NULL;
        }
        PyObject *node = PyTuple_GET_ITEM(e, 1);
        int live = ce_is_leaf(node, PyTuple_GET_ITEM(e, 0));
        if (live > 0)
            Py_INCREF(node);
        Py_DECREF(e);
        if (live < 0)
            return NULL;
        if (live)
            return node;
    }
    return NULL;
}

/* A member of an LRU list's link field (0 for the previous, 1 for the next): its offset, or
 * 0 with TypeError for an object that is neither a record nor a sentinel. */
static Py_ssize_t
ce_link_off(PyObject *o, int next)
{
    Py_ssize_t off = next ? lru_next_off(o) : lru_prev_off(o);
    if (off == 0)
        PyErr_Format(PyExc_TypeError, "evict: an LRU list member of type %.100s",
                     Py_TYPE(o)->tp_name);
    return off;
}

/* _unlink(rec): LruList.remove of a record, its neighbours joined, its links None. */
static int
ce_unlink(PyObject *rec)
{
    PyObject *prev = pyslot_get(rec, AD_lru_prev, "lru_prev");
    if (prev == NULL)
        return -1;
    PyObject *nxt = pyslot_get(rec, AD_lru_next, "lru_next");
    if (nxt == NULL)
        return -1;
    Py_ssize_t prev_next = ce_link_off(prev, 1);
    if (prev_next == 0)
        return -1;
    Py_ssize_t nxt_prev = ce_link_off(nxt, 0);
    if (nxt_prev == 0)
        return -1;
    Py_INCREF(prev);
    Py_INCREF(nxt);
    pyslot_set(prev, prev_next, nxt);
    pyslot_set(nxt, nxt_prev, prev);
    pyslot_set(rec, AD_lru_prev, Py_None);
    pyslot_set(rec, AD_lru_next, Py_None);
    Py_DECREF(prev);
    Py_DECREF(nxt);
    return 0;
}

/* _unhook(node, heap, root): the leaf leaves its parent (`del parent.children[node.ck]`, its
 * parent None, the parent's device-child count down), and the parent, if that made it an
 * evictable leaf (and it is not the root), goes on the heap as (its stamp, it). */
static int
ce_unhook(AuxEvict *ev, PyObject *node)
{
    PyObject *parent = ce_node_field(node, PN_parent, "parent");
    if (parent == NULL)
        return -1;
    Py_INCREF(parent);
    int rc = -1;
    PyObject *children = ce_node_field(parent, PN_children, "children");
    PyObject *ck = children == NULL ? NULL : ce_node_field(node, PN_ck, "ck");
    if (ck == NULL)
        goto done;
    if ((PyDict_CheckExact(children) ? PyDict_DelItem(children, ck)
                                     : PyObject_DelItem(children, ck)) < 0)
        goto done;
    pyslot_set(node, PN_parent, Py_None);
    long long dc;
    if (pyslot_ll(parent, PN_dev_children, "dev_children", &dc) < 0
            || pyslot_set_ll(parent, PN_dev_children, dc - 1) < 0)
        goto done;
    rc = 0;
    if (parent == ev->root || dc - 1 != 0)
        goto done;
    int leaf = ce_is_leaf(parent, NULL);  /* (dev_children read again: it is 0) */
    if (leaf <= 0) {
        rc = leaf;
        goto done;
    }
    PyObject *stamp = pyslot_get(parent, PN_last_access_time, "last_access_time");
    rc = stamp == NULL ? -1 : pn_heap_push(ev->heap, stamp, parent);
done:
    Py_DECREF(parent);
    return rc;
}

/* FreeBatch.add(method, slots): onto the last run when it has that method, else a new run. */
static int
ce_add(AuxEvict *ev, PyObject *method, PyObject *slots)
{
    Py_ssize_t n = PyList_GET_SIZE(ev->runs);
    if (n > 0) {
        PyObject *last = PyList_GET_ITEM(ev->runs, n - 1);
        if (!PyTuple_CheckExact(last) || PyTuple_GET_SIZE(last) != 2) {
            PyErr_SetString(PyExc_TypeError, "evict: a free run that is not (method, pieces)");
            return -1;
        }
        int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(last, 0), method, Py_EQ);
        if (same < 0)
            return -1;
        if (same) {
            PyObject *pieces = PyTuple_GET_ITEM(last, 1);
            if (PyList_CheckExact(pieces))
                return PyList_Append(pieces, slots);
            return discard(PyObject_CallMethod(pieces, "append", "O", slots));
        }
    }
    PyObject *pieces = PyList_New(1);
    if (pieces == NULL)
        return -1;
    PyList_SET_ITEM(pieces, 0, Py_NewRef(slots));
    PyObject *run = PyTuple_Pack(2, method, pieces);
    Py_DECREF(pieces);
    if (run == NULL)
        return -1;
    int r = PyList_Append(ev->runs, run);
    Py_DECREF(run);
    return r;
}

/* The counters into their attributes (before an event callback, and at the end). */
static int
ce_flush(AuxEvict *ev)
{
    if (set_ll(ev->comp, s_comp_evictable, ev->comp_ev) < 0)
        return -1;
    return set_ll(ev->cache, s_evictable, ev->cache_ev);
}

/* events.removed(node) with the counters as the Python has them at that point, read again
 * after it. */
static int
ce_removed(AuxEvict *ev, PyObject *node)
{
    if (ce_flush(ev) < 0)
        return -1;
    if (discard(PyObject_CallMethodOneArg(ev->events, s_ce_removed, node)) < 0)
        return -1;
    if (get_ll(ev->comp, s_comp_evictable, &ev->comp_ev) < 0)
        return -1;
    return get_ll(ev->cache, s_evictable, &ev->cache_ev);
}

/* The end of _delete_leaf_one for a leaf whose component data went: its Full slots queued
 * (a "free" run, or the KV list), its units counted, its value None, then _unhook.  k: the
 * key's length, or -1 when it is read here (the Mamba loops read it after queueing). */
static int
ce_leaf_full(AuxEvict *ev, PyObject *node, Py_ssize_t k)
{
    PyObject *value = ce_node_field(node, PN_value, "value");
    if (value == NULL)
        return -1;
    if ((ev->is_swa ? ce_add(ev, s_free, value) : PyList_Append(ev->kv, value)) < 0)
        return -1;
    if (k < 0 && (k = pn_key_len(node)) < 0)
        return -1;
    ev->full += k;
    ev->cache_ev -= k;
    pyslot_set(node, PN_value, Py_None);
    return ce_unhook(ev, node);
}

/* An evict's view of the node's record (node.aux[0], a new reference), checked to be an AuxData; NULL with an
 * error. */
static PyObject *
ce_rec(PyObject *node)
{
    PyObject *rec = pn_rec(node);
    if (rec != NULL && !AD_IS(rec)) {
        PyErr_Format(PyExc_TypeError, "evict: a component record of type %.100s, not AuxData",
                     Py_TYPE(rec)->tp_name);
        Py_CLEAR(rec);
    }
    return rec;
}

/* The first loop's step: the popped leaf `node` deleted (_delete_leaf_one as written out in
 * evict_swa and _evict_mamba). */
static int
ce_delete_popped(AuxEvict *ev, PyObject *node)
{
    if (ev->events != NULL && ce_removed(ev, node) < 0)
        return -1;
    PyObject *rec = ce_rec(node);  /* (its fields read and written through their offsets) */
    if (rec == NULL)
        return -1;
    int rc = -1;
    Py_ssize_t k = -1;
    if (ev->is_swa && (k = pn_key_len(node)) < 0)
        goto done;
    PyObject *rv = pyslot_get(rec, AD_value, "value");
    if (rv == NULL)
        goto done;
    if (rv != Py_None) {
        long long u = ev->is_swa ? k : 1;
        ev->units += u;
        ev->comp_ev -= u;
        if (ce_unlink(rec) < 0)
            goto done;
        if (!ev->is_swa && PyList_Append(ev->states, rv) < 0)
            goto done;
        pyslot_set(rec, AD_value, Py_None);
    }
    rc = ce_leaf_full(ev, node, k);
done:
    Py_DECREF(rec);
    return rc;
}

/* The second loop's step on record x (not locked; x.lock == 0 checked): its node deleted
 * when an evictable leaf, else its component data dropped (SWA: a tombstone whose SWA slots
 * go as a "free_swa" run; Mamba: the state). */
static int
ce_drop_record(AuxEvict *ev, PyObject *x)
{
    PyObject *node = pyslot_get(x, AD_node, "node");
    if (node == NULL)
        return -1;
    Py_INCREF(node);
    int rc = -1;
    Py_ssize_t k = -1;
    if (ce_check_node(node) < 0 || (ev->is_swa && (k = pn_key_len(node)) < 0))
        goto done;
    int leaf = ce_is_leaf(node, NULL);
    if (leaf < 0)
        goto done;
    if (leaf && ev->events != NULL && ce_removed(ev, node) < 0)
        goto done;
    long long u = ev->is_swa ? k : 1;
    ev->units += u;
    ev->comp_ev -= u;
    if (ce_unlink(x) < 0)
        goto done;
    if (ev->is_swa) {
        if (leaf) {
            pyslot_set(x, AD_value, Py_None);
            rc = ce_leaf_full(ev, node, k);
        } else {
            PyObject *value = ce_node_field(node, PN_value, "value");
            if (value == NULL || ce_add(ev, s_free_swa, value) < 0)
                goto done;
            pyslot_set(x, AD_value, Py_None);
            rc = 0;
        }
    } else {
        PyObject *rv = pyslot_get(x, AD_value, "value");
        if (rv == NULL || PyList_Append(ev->states, rv) < 0)
            goto done;
        pyslot_set(x, AD_value, Py_None);
        rc = leaf ? ce_leaf_full(ev, node, -1) : 0;
    }
done:
    Py_DECREF(node);
    return rc;
}

/* An amount as a C long long: an exact int >= 0 (one past LLONG_MAX counts as LLONG_MAX:
 * no tree holds that many units); -1 for anything else (the call declines). */
static long long
ce_amount(PyObject *o)
{
    if (!PyLong_CheckExact(o))
        return -1;
    int ovf;
    long long x = PyLong_AsLongLongAndOverflow(o, &ovf);
    if (ovf > 0)
        return LLONG_MAX;
    return ovf < 0 ? -1 : x;
}

/* The start of an evict's loops: the cache's heap, root and events (ev->events NULL for None)
 * and its counter and the component's, read.  1: go on (ce_release drops what it read); 0:
 * declined, with no error set (a missing attribute too: the Python path meets it where it
 * reads it; ce_release still drops what was read). */
static int
ce_begin(AuxEvict *ev)
{
    ev->heap = PyObject_GetAttr(ev->cache, s_heap);
    ev->root = ev->heap == NULL ? NULL : PyObject_GetAttr(ev->cache, s_root_node);
    ev->events = ev->root == NULL ? NULL : PyObject_GetAttr(ev->cache, s_events);
    int ok = ev->events != NULL;
    if (ok && ev->events == Py_None)
        Py_CLEAR(ev->events);
    if (ok)
        ok = attr_ll(ev->cache, s_evictable, &ev->cache_ev);
    if (ok > 0)
        ok = attr_ll(ev->comp, s_comp_evictable, &ev->comp_ev);
    if (ok > 0 && PyList_CheckExact(ev->heap) && PN_IS(ev->root))
        return 1;
    PyErr_Clear();
    return 0;
}

/* What ce_begin read, dropped. */
static void
ce_release(AuxEvict *ev)
{
    Py_CLEAR(ev->heap);
    Py_CLEAR(ev->root);
    Py_CLEAR(ev->events);
}

/* The first loop: the oldest evictable leaves off the heap until `want` Full units went,
 * each one handed to `delete_leaf(ctx, node)`.  0, or -1 with an error. */
static int
ce_leaf_loop(AuxEvict *ev, long long want, int (*delete_leaf)(void *, PyObject *), void *ctx)
{
    while (ev->full < want) {
        PyObject *node = ce_pop_leaf(ev->heap);
        if (node == NULL)
            return PyErr_Occurred() ? -1 : 0;
        int r = delete_leaf(ctx, node);
        Py_DECREF(node);
        if (r < 0)
            return -1;
    }
    return 0;
}

/* A component's drive: its LRU list from the oldest record while *units < want, each record
 * that is not locked handed to `step(ctx, x)` (its node deleted, or its data dropped).  0, or
 * -1 with an error. */
static int
ce_drive(PyObject *comp, long long want, const long long *units,
         int (*step)(void *, PyObject *), void *ctx)
{
    PyObject *lru = PyObject_GetAttr(comp, s_lru);
    if (lru == NULL)
        return -1;
    PyObject *head = PyObject_GetAttr(lru, s_head);
    PyObject *tail = head == NULL ? NULL : PyObject_GetAttr(lru, s_ce_tail);
    Py_DECREF(lru);
    if (tail == NULL) {
        Py_XDECREF(head);
        return -1;
    }
    PyObject *x = SE_IS(tail) ? Py_XNewRef(pyslot_get(tail, SE_lru_prev, "lru_prev"))
                              : PyObject_GetAttr(tail, s_lru_prev);
    Py_DECREF(tail);
    int rc = x == NULL ? -1 : 0;
    while (rc == 0 && *units < want && x != head) {
        if (!AD_IS(x)) {
            PyErr_Format(PyExc_TypeError, "evict: an LRU list member of type %.100s",
                         Py_TYPE(x)->tp_name);
            rc = -1;
            break;
        }
        PyObject *nxt = pyslot_get(x, AD_lru_prev, "lru_prev");
        if (nxt == NULL) {
            rc = -1;
            break;
        }
        Py_INCREF(nxt);  /* (evicting x never unlinks another record of the list) */
        PyObject *lock = pyslot_get(x, AD_lock, "lock");
        int free_ = lock == NULL ? -1 : py_eq_zero(lock);
        if (free_ > 0 && step(ctx, x) < 0)
            free_ = -1;
        Py_SETREF(x, nxt);
        if (free_ < 0)
            rc = -1;
    }
    Py_XDECREF(x);
    Py_DECREF(head);
    return rc;
}

static int
ce_popped_step(void *ev, PyObject *node)
{
    return ce_delete_popped((AuxEvict *)ev, node);
}

static int
ce_record_step(void *ev, PyObject *x)
{
    return ce_drop_record((AuxEvict *)ev, x);
}

/* The two loops of the evict (see the section's comment).  Returns (Full units, the
 * component's units), None having changed nothing (declined), or NULL with an error. */
static PyObject *
aux_evict_run(AuxEvict *ev, PyObject *want_o, PyObject *aux_want_o)
{
    long long want = ce_amount(want_o), aux_want = ce_amount(aux_want_o);
    if (g_pn_type == NULL || want < 0 || aux_want < 0)
        Py_RETURN_NONE;
    if (!ce_begin(ev)) {
        ce_release(ev);
        Py_RETURN_NONE;
    }
    /* from here on the tree changes: the counters are written back on every way out */
    PyObject *result = NULL;
    ev->full = ev->units = 0;
    if (ce_leaf_loop(ev, want, ce_popped_step, ev) == 0
            && ce_drive(ev->comp, aux_want, &ev->units, ce_record_step, ev) == 0)
        result = Py_BuildValue("(LL)", ev->full, ev->units);
    /* (write_back keeps a pending error as the one raised) */
    if (write_back(ev->comp, s_comp_evictable, ev->comp_ev) < 0)
        Py_CLEAR(result);
    if (write_back(ev->cache, s_evictable, ev->cache_ev) < 0)
        Py_CLEAR(result);
    ce_release(ev);
    return result;
}

/* aux_evict_swa(cache, comp, want, swa_want, runs): evict_swa's loops, the pieces added to
 * `runs` (its FreeBatch's) as FreeBatch.add would. */
static PyObject *
core_aux_evict_swa(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(5, "aux_evict_swa(cache, comp, want, swa_want, runs)");
    if (!PyList_CheckExact(args[4]))
        Py_RETURN_NONE;
    AuxEvict ev = {0};
    ev.cache = args[0];
    ev.comp = args[1];
    ev.is_swa = 1;
    ev.runs = args[4];
    return aux_evict_run(&ev, args[2], args[3]);
}

/* aux_evict_mamba(cache, comp, want, mamba_want, kv, states): _evict_mamba's loops, the
 * deleted leaves' Full slots appended to `kv`, the dropped states to `states`. */
static PyObject *
core_aux_evict_mamba(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(6, "aux_evict_mamba(cache, comp, want, mamba_want, kv, states)");
    if (!PyList_CheckExact(args[4]) || !PyList_CheckExact(args[5]))
        Py_RETURN_NONE;
    AuxEvict ev = {0};
    ev.cache = args[0];
    ev.comp = args[1];
    ev.is_swa = 0;
    ev.kv = args[4];
    ev.states = args[5];
    return aux_evict_run(&ev, args[2], args[3]);
}

/* ------------------------------------------------------------------------------------------ */
/* composed tree: pair evict (fast/pair_evict.py evict_pair, its loops in C)                   */
/* ------------------------------------------------------------------------------------------ */
/*
 * The evict of the composed tree with the stock SWA and Mamba plug-ins together and no host
 * tier (fast/pair_evict.py evict_pair, the general driver written out): the oldest evictable
 * leaves off the Full heap, then each component's LRU list from its oldest record, in
 * component order; an evictable leaf leaves the tree with both records' data, an internal
 * node loses the list's component's data (SWA: a tombstone whose SWA slots go as a
 * "free_swa" run, and by the cascade the node's Mamba state where it is not locked; Mamba:
 * the state).  The cevict section's pieces do the shared steps (the heap pops, the leaf
 * test, the unlinks, the unhook and its parent push, the runs, the counters and the event
 * calls); the SWA side is cevict's AuxEvict with its runs (the Full slots as "free" runs),
 * the Mamba side its own counters and the FreeBatch's states.  The same rules as cevict's:
 * only the lists are filled (the caller's `finally` hands them back), the counters are
 * written back once at the end and around each event call, a call declines (None, nothing
 * changed) where its arguments are not what evict_pair passes.
 */

typedef struct {
    AuxEvict ev;         /* the cache, SWA (ev.comp, ev.comp_ev, ev.units) and the Full side */
    PyObject *mamba;     /* the Mamba component */
    long long mamba_ev;  /* mamba.evictable */
    long long mamba_units;
    Py_ssize_t si, mi;   /* the SWA and Mamba records' places in node.aux */
} PairEvict;

/* events.removed(node) with all three counters as the Python has them, read again after. */
static int
pe_removed(PairEvict *pe, PyObject *node)
{
    if (set_ll(pe->mamba, s_comp_evictable, pe->mamba_ev) < 0 || ce_removed(&pe->ev, node) < 0)
        return -1;
    return get_ll(pe->mamba, s_comp_evictable, &pe->mamba_ev);
}

/* node.aux[i] (new reference), which must be exactly an AuxData; NULL with an error. */
static PyObject *
pe_rec(PyObject *node, Py_ssize_t i)
{
    PyObject *rec = pn_rec_at(node, i);
    if (rec != NULL && !AD_IS(rec)) {
        PyErr_Format(PyExc_TypeError, "evict: a component record of type %.100s, not AuxData",
                     Py_TYPE(rec)->tp_name);
        Py_CLEAR(rec);
    }
    return rec;
}

/* Mamba's drop of record rec holding state v (borrowed): counted, unlinked, the state onto
 * the FreeBatch's states, the record's value None. */
static int
pe_drop_state(PairEvict *pe, PyObject *rec, PyObject *v)
{
    pe->mamba_units += 1;
    pe->mamba_ev -= 1;
    Py_INCREF(v);
    int rc = ce_unlink(rec) < 0 ? -1 : PyList_Append(pe->ev.states, v);
    if (rc == 0)
        pyslot_set(rec, AD_value, Py_None);
    Py_DECREF(v);
    return rc;
}

/* _delete_leaf of evict_pair: the event, the SWA record's data (its slots go with the Full
 * slots), the Mamba state, the Full slots as a "free" run, then the unhook. */
static int
pe_delete_leaf(void *ctx, PyObject *node)
{
    PairEvict *pe = ctx;
    if (ce_check_node(node) < 0 || (pe->ev.events != NULL && pe_removed(pe, node) < 0))
        return -1;
    Py_ssize_t k = pn_key_len(node);
    if (k < 0)
        return -1;
    PyObject *rec = pe_rec(node, pe->si);
    if (rec == NULL)
        return -1;
    PyObject *v = pyslot_get(rec, AD_value, "value");
    int rc = v == NULL ? -1 : 0;
    if (v != NULL && v != Py_None) {
        pe->ev.units += k;
        pe->ev.comp_ev -= k;
        rc = ce_unlink(rec);
        if (rc == 0)
            pyslot_set(rec, AD_value, Py_None);
    }
    Py_DECREF(rec);
    if (rc < 0 || (rec = pe_rec(node, pe->mi)) == NULL)
        return -1;
    v = pyslot_get(rec, AD_value, "value");
    rc = v == NULL ? -1 : v == Py_None ? 0 : pe_drop_state(pe, rec, v);
    Py_DECREF(rec);
    return rc < 0 ? -1 : ce_leaf_full(&pe->ev, node, k);
}

/* A record of either list (x, not locked) in its component's drive: its node deleted where
 * it is an evictable leaf, else the component's data dropped (SWA: a tombstone, its slots a
 * "free_swa" run, then the cascade to an unlocked Mamba state on the node). */
static int
pe_drive_step(PairEvict *pe, PyObject *x, int is_swa)
{
    PyObject *node = pyslot_get(x, AD_node, "node");
    if (node == NULL)
        return -1;
    Py_INCREF(node);
    int rc = -1;
    int leaf = ce_check_node(node) < 0 ? -1 : ce_is_leaf(node, NULL);
    if (leaf < 0)
        goto done;
    if (leaf) {
        rc = pe_delete_leaf(pe, node);
        goto done;
    }
    if (!is_swa) {
        PyObject *v = pyslot_get(x, AD_value, "value");
        rc = v == NULL ? -1 : pe_drop_state(pe, x, v);
        goto done;
    }
    Py_ssize_t k = pn_key_len(node);
    if (k < 0)
        goto done;
    pe->ev.units += k;
    pe->ev.comp_ev -= k;
    if (ce_unlink(x) < 0)
        goto done;
    PyObject *value = ce_node_field(node, PN_value, "value");
    if (value == NULL || ce_add(&pe->ev, s_free_swa, value) < 0)
        goto done;
    pyslot_set(x, AD_value, Py_None);
    PyObject *rec = pe_rec(node, pe->mi);  /* the cascade */
    if (rec == NULL)
        goto done;
    PyObject *v = pyslot_get(rec, AD_value, "value");
    rc = v == NULL ? -1 : 0;
    if (v != NULL && v != Py_None) {
        PyObject *lock = pyslot_get(rec, AD_lock, "lock");
        int unlocked = lock == NULL ? -1 : py_eq_zero(lock);
        rc = unlocked < 0 ? -1 : unlocked ? pe_drop_state(pe, rec, v) : 0;
    }
    Py_DECREF(rec);
done:
    Py_DECREF(node);
    return rc;
}

static int
pe_swa_step(void *pe, PyObject *x)
{
    return pe_drive_step((PairEvict *)pe, x, 1);
}

static int
pe_mamba_step(void *pe, PyObject *x)
{
    return pe_drive_step((PairEvict *)pe, x, 0);
}

/* pair_evict(cache, swa, mamba, want, swa_want, mamba_want, runs, states): evict_pair's
 * loops, the pieces added to `runs` (its FreeBatch's) as FreeBatch.add would and the states
 * to `states`.  (Full units, SWA units, Mamba states), None having changed nothing
 * (declined), or NULL with an error. */
static PyObject *
core_pair_evict(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(8, "pair_evict(cache, swa, mamba, want, swa_want, mamba_want, runs, states)");
    long long want = ce_amount(args[3]), swa_want = ce_amount(args[4]),
              mamba_want = ce_amount(args[5]);
    if (g_pn_type == NULL || want < 0 || swa_want < 0 || mamba_want < 0
            || !PyList_CheckExact(args[6]) || !PyList_CheckExact(args[7]))
        Py_RETURN_NONE;
    PairEvict pe = {{0}};
    pe.ev.cache = args[0];
    pe.ev.comp = args[1];
    pe.ev.is_swa = 1;  /* (the Full slots go as "free" runs) */
    pe.ev.runs = args[6];
    pe.ev.states = args[7];
    pe.mamba = args[2];
    long long si, mi;
    int ok = ce_begin(&pe.ev);
    if (ok > 0)
        ok = attr_ll(pe.mamba, s_comp_evictable, &pe.mamba_ev);
    if (ok > 0)
        ok = attr_ll(pe.ev.comp, s_ck_i, &si);
    if (ok > 0)
        ok = attr_ll(pe.mamba, s_ck_i, &mi);
    if (ok <= 0 || si < 0 || si > 1 || mi != 1 - si) {
        PyErr_Clear();
        ce_release(&pe.ev);
        Py_RETURN_NONE;
    }
    pe.si = (Py_ssize_t)si;
    pe.mi = (Py_ssize_t)mi;
    /* from here on the tree changes: the counters are written back on every way out */
    PyObject *result = NULL;
    int rc = ce_leaf_loop(&pe.ev, want, pe_delete_leaf, &pe);
    for (int i = 0; i < 2 && rc == 0; i++)  /* each component's drive, in component order */
        rc = i == si ? ce_drive(pe.ev.comp, swa_want, &pe.ev.units, pe_swa_step, &pe)
                     : ce_drive(pe.mamba, mamba_want, &pe.mamba_units, pe_mamba_step, &pe);
    if (rc == 0)
        result = Py_BuildValue("(LLL)", pe.ev.full, pe.ev.units, pe.mamba_units);
    /* (write_back keeps a pending error as the one raised) */
    if (write_back(pe.ev.comp, s_comp_evictable, pe.ev.comp_ev) < 0)
        Py_CLEAR(result);
    if (write_back(pe.mamba, s_comp_evictable, pe.mamba_ev) < 0)
        Py_CLEAR(result);
    if (write_back(pe.ev.cache, s_evictable, pe.ev.cache_ev) < 0)
        Py_CLEAR(result);
    ce_release(&pe.ev);
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* composed tree: cinsert                                                                      */
/* ------------------------------------------------------------------------------------------ */
/*
 * one_plan: fast/cache.py _plan's walk (insert_one's plan, before anything changes), one C call.
 * one_insert: fast/one_aux.py insert_one from its walk on (the checks and the root's stamp stay
 * in Python): each planned node touched (stamp, leaf push, its record to the front
 * of the component's list), split where the insert ends inside it, an SWA tombstone's overlap,
 * the caller's duplicates queued, the new leaf (its Full slots and, over sglang's map, its SWA
 * slots in one pass: swa_leaf), the component's commit and, for Mamba over the native frees,
 * the queue's release.  Same steps, same order, same objects as the Python loop; the calls
 * that do more than a field write (the cache's _split, _free and _stamp, the SWA component's
 * overlap and translate, the Mamba component's on_set, the Node and AuxData constructors) are
 * the same Python calls.  The Python loop ran about 20 attribute reads and writes per planned
 * node through the interpreter; here they are slot stores (setup_pynode's offsets, for objects
 * of exactly those classes; anything else goes through ordinary attribute access).
 *
 * The cache's _clock is kept in a C local: written back before every Python call that may read
 * or move it (_split, overlap, _stamp) and read again after, and at the end, error paths too.
 * KV events (the new leaf's ``stored``) and the slot ledger (validate_slots: the leaf's slots
 * owned) are the same calls too.  It declines (None, nothing changed) for what the Python
 * loop takes and this does not: a _heap (or, for the direct frees, a _deferred) that is not
 * a plain list, a plan entry that is not a (node, int) pair, units that are not an int64
 * buffer of n items, an int argument that is not a plain int.
 */

static PyObject *s_ci_i, *s_ci_deferred, *s_ci_overlap, *s_ci_free_m, *s_ci_translate, *s_ci_stamp_m,
    *s_ci_tracks, *s_ci_on_set, *s_ci_map_pool, *s_ci_swa_leaf, *s_ci_stored;

/* value[lo:hi] (a view, as the Python slice), new reference: the native frees' tail_view,
 * which makes exactly that slice. */
#define ci_slice tail_view

/* The cache's _clock in a C local: stored before a Python call that may read it, read after. */
static int
ci_clock_out(PyObject *cache, long long clock)
{
    return set_ll(cache, s_clock, clock);
}

static int
ci_clock_in(PyObject *cache, long long *clock)
{
    return get_ll(cache, s_clock, clock);
}

/* Call cache.name(node, k) with the clock synced around it; the result (new reference). */
static PyObject *
ci_call2(PyObject *obj, PyObject *cache, PyObject *name, PyObject *node, Py_ssize_t k,
         long long *clock)
{
    if (ci_clock_out(cache, *clock) < 0)
        return NULL;
    PyObject *kk = PyLong_FromSsize_t(k);
    if (kk == NULL)
        return NULL;
    PyObject *a[3] = {obj, node, kk};
    PyObject *r = PyObject_VectorcallMethod(name, a, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(kk);
    if (r == NULL || ci_clock_in(cache, clock) < 0) {
        Py_XDECREF(r);
        return NULL;
    }
    return r;
}

static PyObject *
ci_result(Py_ssize_t pos, Py_ssize_t total, int exist)
{
    PyObject *a0 = PyLong_FromSsize_t(pos), *a1 = a0 == NULL ? NULL : PyLong_FromSsize_t(total);
    if (a1 == NULL) {
        Py_XDECREF(a0);
        return NULL;
    }
    PyObject *a[3] = {a0, a1, exist ? Py_True : Py_False};
    PyObject *r = PyObject_Vectorcall(g_InsertResult, a, 3, NULL);
    Py_DECREF(a0);
    Py_DECREF(a1);
    return r;
}

/* The components an insert commits to: one (one_insert: the record aux[0]) or the stock SWA
 * and Mamba plug-ins together (pair_insert: their records at their indices), in component
 * order; which of them is SWA (-1: none). */
typedef struct {
    int nc;
    PyObject *comp[2];  /* (borrowed) */
    Py_ssize_t idx[2];
    int swa_at;
} CiShape;

static PyObject *ci_insert(PyObject *mod, PyObject *cache, const CiShape *sh,
                           PyObject *const *args);

/* The int arguments args[i] for i in ints (exact ints that fit): 1, or 0 (declined). */
static int
ci_ints(PyObject *const *args, const int *ints, int k, Py_ssize_t *out)
{
    for (int j = 0; j < k; j++) {
        PyObject *o = args[ints[j]];
        if (!PyLong_CheckExact(o))
            return 0;
        out[j] = PyLong_AsSsize_t(o);
        if (out[j] == -1 && PyErr_Occurred()) {  /* (a huge int: the Python loop's) */
            PyErr_Clear();
            return 0;
        }
    }
    return 1;
}

/* one_insert(cache, comp, swa, plan, value, units, extra_key, prev, e, n, total, prepared,
 *            direct, page_size) -> InsertResult, or None (nothing changed): see above. */
static PyObject *
core_one_insert(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(14, "one_insert(cache, comp, swa, plan, value, units, "
         "extra_key, prev, e, n, total, prepared, direct, page_size)");
    CiShape sh = {1, {args[1], NULL}, {0, 0}, args[2] != Py_None ? 0 : -1};
    /* (cache, swa, plan, value, units, extra_key, prev, e, n, total, prepared, direct, ps) */
    PyObject *a[13] = {args[0], args[2], args[3], args[4], args[5], args[6], args[7], args[8],
                       args[9], args[10], args[11], args[12], args[13]};
    return ci_insert(mod, args[0], &sh, a);
}

/* pair_insert(cache, swa, mamba, plan, value, units, extra_key, prev, e, n, total, state,
 *             page_size) -> InsertResult, or None (nothing changed): fast/hybrid.py _insert's
 * general path from its walk on for the stock SWA and Mamba plug-ins together (``_pair``; no
 * host tier, the lru order, the stock hooks: the caller checks), the same steps as
 * one_insert's with both records: each planned node's records to the front of their lists
 * in component order, the new leaf with two records, each plug-in's commit in component
 * order (SWA's data inside the window, the Mamba state ``state``).  The caller's duplicates
 * go through the cache's _free (its queue, released by ``insert``).  Declined as one_insert,
 * and for a planned node without Full data (the general path's unevict, a host tier's).
 * tests/fast/test_pair_insert.py runs this against the general path. */
static PyObject *
core_pair_insert(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(13, "pair_insert(cache, swa, mamba, plan, value, units, "
         "extra_key, prev, e, n, total, state, page_size)");
    PyObject *swa = args[1], *mamba = args[2];
    PyObject *si = PyObject_GetAttr(swa, s_ci_i), *mi = si == NULL ? NULL
        : PyObject_GetAttr(mamba, s_ci_i);
    Py_ssize_t i_s = -1, i_m = -1;
    if (mi != NULL && PyLong_CheckExact(si) && PyLong_CheckExact(mi)) {
        i_s = PyLong_AsSsize_t(si);
        i_m = PyLong_AsSsize_t(mi);
    }
    Py_XDECREF(si);
    Py_XDECREF(mi);
    if (i_s < 0 || i_m < 0 || i_s > 1 || i_m > 1 || i_s == i_m) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    CiShape sh;
    sh.nc = 2;
    sh.comp[i_s] = swa;
    sh.comp[i_m] = mamba;
    sh.idx[i_s] = i_s;
    sh.idx[i_m] = i_m;
    sh.swa_at = (int)i_s;
    PyObject *a[13] = {args[0], swa, args[3], args[4], args[5], args[6], args[7], args[8],
                       args[9], args[10], args[11], Py_False, args[12]};
    return ci_insert(mod, args[0], &sh, a);
}

/* pair_insert_api(cache, params) -> InsertResult, or None (nothing changed): fast/hybrid.py
 * _insert whole for the stock SWA and Mamba plug-ins together (the pair's ``_insert_fast``,
 * called by ``insert``, which releases the queued frees): the key read in place (plain_key:
 * uniradix's RadixKey, or sglang's shape, over an array('q')), insert_args' checks (value an
 * exact int64 tensor of one slot per token, prev_prefix_len an int >= 0, chunked a bool,
 * priority an int), the cut to whole pages, the plan (one_plan), the pair's written-out aux
 * checks in _insert's order (swa_evicted_seqlen an int >= 0 of whole pages; SWA's
 * check_insert loop where prev_prefix_len > 0, before or after mamba_state's checks as SWA
 * comes before or after Mamba), then mamba_state's copy (state_copy, else clone()), the
 * root's stamp, the answer for no whole page, and pair_insert's walk, leaf and commits.
 * Where the Python function would raise, or do anything this does not write out (a bigram or
 * EAGLE key, list token ids, the slot ledger, a disabled cache, KV events, a storage or host
 * tier, a policy order, a non-exact int or tensor), it declines before changing anything: the
 * Python function then runs from its start with its own checks and messages.  The value is
 * passed to pair_insert uncut: it reads only value[0:n], the views and copies _insert makes
 * of its cut view (same storage, same offsets).  tests/fast/test_pair_insert_api.py runs this
 * against the Python function in lockstep. */
static PyObject *core_one_plan(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
static PyObject *s_pi_seqlen, *s_pi_mamba_value, *s_pi_priority, *s_pi_storage, *s_pi_tier,
    *s_pi_policy, *s_pi_pair_insert, *s_pi_swa, *s_pi_mamba, *s_pi_step, *s_pi_clone;

/* SwaComponent.check_insert's loop (prev > 0): 1 where prev_prefix_len falls inside an SWA
 * tombstone this insert would restore (the Python method raises), 0 where not, -1 on error. */
static int
pi_swa_refuses(PyObject *plan, Py_ssize_t prev, Py_ssize_t e, Py_ssize_t swa_i)
{
    Py_ssize_t start = 0, np = PyList_GET_SIZE(plan);
    for (Py_ssize_t i = 0; i < np; i++) {
        PyObject *it = PyList_GET_ITEM(plan, i);
        PyObject *node = PyTuple_GET_ITEM(it, 0);
        Py_ssize_t shared = PyLong_AsSsize_t(PyTuple_GET_ITEM(it, 1));
        if (shared == -1 && PyErr_Occurred())
            return -1;
        if (start < prev && prev < start + shared && e < start + shared) {
            PyObject *v = PN_GET(node, value);
            if (v == NULL)
                return -1;
            int has = v != Py_None;
            Py_DECREF(v);
            if (has) {
                PyObject *rec = pn_rec_at(node, swa_i);
                int held = rec == NULL ? -1 : rec_holds(rec);
                Py_XDECREF(rec);
                if (held < 0)
                    return -1;
                if (!held)
                    return 1;
            }
        }
        start += shared;
    }
    return 0;
}

/* o is an exact int that fits (*out), >= 0: 1; else 0 (an error cleared). */
static int
pi_count(PyObject *o, Py_ssize_t *out)
{
    if (o == NULL || !PyLong_CheckExact(o))
        return 0;
    *out = PyLong_AsSsize_t(o);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return *out >= 0;
}

/* cache.<name> is None: 1; anything else 0; -1 on error (a missing attribute: 0). */
static int
pi_attr_none(PyObject *cache, PyObject *name)
{
    PyObject *v = NULL;
    int r = optional_attr(cache, name, &v);
    if (r <= 0)
        return r;
    r = v == Py_None;
    Py_DECREF(v);
    return r;
}

/* What pair_insert_api and one_insert_api read before their components' checks (fast/hybrid.py
 * _insert's prologue and fast/one_aux.py insert_one's alike): the key in place, the argument
 * checks, the cut to whole pages, the plan, swa_evicted_seqlen (unchecked: each has its rule),
 * and (pi_ready) the leaf heap, the root's stamp and the clock as they were. */
typedef struct {
    PyObject *key, *toks, *ek, *value, *prev, *ps_o, *units, *root, *step, *plan, *e_o, *n_o,
        *total_o, *heap, *old_stamp;
    /* (what the callers' own checks read, cleared with the rest) */
    PyObject *swa, *mamba, *comps, *pair, *mv, *deferred, *state;
    Py_ssize_t total, prev_n, ps, n, e;
    long long old_clock;
} PiArgs;

static void
pi_clear(PiArgs *a)
{
    PyObject **owned[] = {&a->key, &a->toks, &a->ek, &a->value, &a->prev, &a->ps_o, &a->units,
                          &a->root, &a->step, &a->plan, &a->e_o, &a->n_o, &a->total_o, &a->heap,
                          &a->old_stamp, &a->swa, &a->mamba, &a->comps, &a->pair, &a->mv,
                          &a->deferred, &a->state};
    for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++)
        Py_CLEAR(*owned[i]);
}

/* The settings the callers write out (cache.<flag> True: the entry's hooks as the class has
 * them; no tier, no storage tier, no KV events, no policy order, no slot ledger; plain_key:
 * not EAGLE, not disabled), then the prologue in its order into *a: 1 read, 0 declined (the
 * error cleared; what was read stays in *a for pi_clear). */
static int
pi_read(PyObject *mod, PyObject *cache, PyObject *params, PyObject *flag, PiArgs *a)
{
    PyObject *o = NULL;
    int r;
    if (g_pn_type == NULL || g_InsertResult == NULL || g_Tensor == NULL || g_int64 == NULL
            || g_RadixKey == NULL || g_array == NULL)
        return 0;  /* (before setup_pynode / setup_api: the Python function) */
    if ((o = PyObject_GetAttr(cache, flag)) == NULL || o != Py_True)
        goto decline;
    Py_CLEAR(o);
    if (pi_attr_none(cache, s_pi_tier) != 1 || pi_attr_none(cache, s_pi_storage) != 1
            || pi_attr_none(cache, s_events) != 1 || pi_attr_none(cache, s_pi_policy) != 1
            || attr_is_false(cache, s_validate_slots) != 1)
        goto decline;
    if ((a->key = PyObject_GetAttr(params, s_key)) == NULL
            || plain_key(cache, a->key, &a->toks, &a->ek) != 1)
        goto decline;
    Py_ssize_t vn = -1;
    if ((a->total = PyObject_Length(a->toks)) < 0)
        goto decline;
    /* insert_args: value, prev_prefix_len, chunked, priority */
    if ((a->value = PyObject_GetAttr(params, s_value)) == NULL
            || (PyObject *)Py_TYPE(a->value) != g_Tensor || int64_1d_len(a->value, &vn) != 1
            || vn != a->total)
        goto decline;
    if ((a->prev = PyObject_GetAttr(params, s_prev)) == NULL || !pi_count(a->prev, &a->prev_n))
        goto decline;
    if ((o = PyObject_GetAttr(params, s_chunked)) == NULL || (o != Py_True && o != Py_False))
        goto decline;
    Py_CLEAR(o);
    if ((r = optional_attr(params, s_pi_priority, &o)) < 0 || (r && !PyLong_CheckExact(o)))
        goto decline;  /* (missing: 0, as getattr's default) */
    Py_CLEAR(o);
    /* the cut to whole pages and the plan */
    if ((a->ps_o = PyObject_GetAttr(cache, s_page_size)) == NULL || !pi_count(a->ps_o, &a->ps)
            || a->ps < 1)
        goto decline;
    a->n = a->total - a->total % a->ps;
    a->units = a->n < a->total ? PySequence_GetSlice(a->toks, 0, a->n) : Py_NewRef(a->toks);
    if (a->units == NULL || (a->root = PyObject_GetAttr(cache, s_root_node)) == NULL
            || !PN_IS(a->root) || (a->step = PyObject_GetAttr(mod, s_pi_step)) == NULL)
        goto decline;
    {
        PyObject *c[5] = {a->root, a->units, a->ek, a->ps_o, a->step};
        if ((a->plan = core_one_plan(mod, c, 5)) == NULL)
            goto decline;
    }
    if ((a->e_o = PyObject_GetAttr(params, s_pi_seqlen)) == NULL
            || (a->n_o = PyLong_FromSsize_t(a->n)) == NULL
            || (a->total_o = PyLong_FromSsize_t(a->total)) == NULL)
        goto decline;
    return 1;
decline:
    Py_XDECREF(o);
    PyErr_Clear();
    return 0;
}

/* What the walk would decline, checked before anything changes (the leaf heap a plain list),
 * and the root's stamp and the clock as they were (the stamp undone where it declines all the
 * same): 1, or 0 declined (the error cleared). */
static int
pi_ready(PyObject *cache, PiArgs *a)
{
    if ((a->heap = PyObject_GetAttr(cache, s_heap)) == NULL || !PyList_CheckExact(a->heap)
            || (a->old_stamp = PN_GET(a->root, last_access_time)) == NULL
            || get_ll(cache, s_clock, &a->old_clock) < 0) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* params.mamba_value as mamba_state checks it (an exact int64 tensor of shape (1,)): 1 (*mv a
 * new reference), or 0 declined (the error cleared). */
static int
pi_state_arg(PyObject *params, PyObject **mv)
{
    Py_ssize_t one = -1;
    if ((*mv = PyObject_GetAttr(params, s_pi_mamba_value)) == NULL
            || (PyObject *)Py_TYPE(*mv) != g_Tensor || int64_1d_len(*mv, &one) != 1 || one != 1) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* mamba_state's copy of mv: the tree's own tensor (state_copy, else clone()); NULL on error. */
static PyObject *
pi_state_own(PyObject *mod, PyObject *mv)
{
    PyObject *state = core_state_copy(mod, &mv, 1);
    if (state == Py_None)
        Py_SETREF(state, PyObject_CallMethodNoArgs(mv, s_pi_clone));
    return state;
}

/* From here on the cache changes: the root's stamp (``_stamp``: it is locked, no push), the
 * answer for no whole page, else walk(mod, call, ncall) (pair_insert or one_insert); where
 * that declines all the same (checked before, so not expected), the stamp is undone. */
static PyObject *
pi_stamp_walk(PyObject *mod, PyObject *cache, const PiArgs *a,
              PyObject *(*walk)(PyObject *, PyObject *const *, Py_ssize_t),
              PyObject *const *call, Py_ssize_t ncall)
{
    long long clock = a->old_clock + g_stride;
    if (set_ll(cache, s_clock, clock) < 0)
        return NULL;
    PyObject *o = PyLong_FromLongLong(clock);
    int r = o == NULL ? -1 : PN_SET(a->root, last_access_time, o);
    Py_XDECREF(o);
    if (r < 0)
        return NULL;
    if (a->n == 0)
        return ci_result(0, a->total, 1);
    PyObject *result = walk(mod, call, ncall);
    if (result == Py_None) {
        if (set_ll(cache, s_clock, a->old_clock) < 0
                || PN_SET(a->root, last_access_time, a->old_stamp) < 0)
            Py_CLEAR(result);
    }
    return result;
}

/* The entries' frame: fn(cache, params), the prologue (pi_read with cache.<flag>), then
 * rest(mod, cache, params, &a): its components' checks and the rest (the InsertResult, None
 * declined, an error it met cleared here, or NULL on error). */
typedef PyObject *(*PiRest)(PyObject *, PyObject *, PyObject *, PiArgs *);

static PyObject *
pi_entry(PyObject *mod, PyObject *const *args, Py_ssize_t nargs, const char *fn,
         PyObject *flag, PiRest rest)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s(cache, params)", fn);
        return NULL;
    }
    PiArgs a = {0};
    PyObject *result = pi_read(mod, args[0], args[1], flag, &a)
        ? rest(mod, args[0], args[1], &a) : Py_NewRef(Py_None);
    if (result == Py_None)  /* (declined: what was read, and any error, dropped) */
        PyErr_Clear();
    pi_clear(&a);
    return result;
}

/* pair_insert_api after the prologue: the pair's checks, the state, pair_insert (None:
 * declined, the error cleared by pi_entry). */
static PyObject *
pi_pair_rest(PyObject *mod, PyObject *cache, PyObject *params, PiArgs *a)
{
    Py_ssize_t swa_i, mamba_i;
    /* the aux checks, written out as _insert has them */
    if (!pi_count(a->e_o, &a->e) || a->e % a->ps)
        Py_RETURN_NONE;
    PyObject *po = a->pair = PyObject_GetAttr(cache, s_cm_pair);
    if (po == NULL || !PyTuple_CheckExact(po) || PyTuple_GET_SIZE(po) != 3
            || !pi_count(PyTuple_GET_ITEM(po, 0), &swa_i)
            || !pi_count(PyTuple_GET_ITEM(po, 2), &mamba_i) || swa_i > 1 || mamba_i > 1
            || swa_i == mamba_i)
        Py_RETURN_NONE;
    if (a->prev_n && swa_i == 0 && pi_swa_refuses(a->plan, a->prev_n, a->e, swa_i) != 0)
        Py_RETURN_NONE;
    if (!pi_state_arg(params, &a->mv))
        Py_RETURN_NONE;
    if (a->prev_n && swa_i == 1 && pi_swa_refuses(a->plan, a->prev_n, a->e, swa_i) != 0)
        Py_RETURN_NONE;
    /* what pair_insert would decline, checked before anything changes */
    if ((a->swa = PyObject_GetAttr(cache, s_pi_swa)) == NULL
            || (a->mamba = PyObject_GetAttr(cache, s_pi_mamba)) == NULL || !pi_ready(cache, a))
        Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(a->plan); i++) {
        PyObject *it = PyList_GET_ITEM(a->plan, i), *c = PyTuple_GET_ITEM(it, 0);
        if (!PN_IS(c) || IS_NONE(SLOT_AT(c, PN_value))
                || !PyLong_CheckExact(PyTuple_GET_ITEM(it, 1)))
            Py_RETURN_NONE;
    }
    /* mamba_state's copy: the tree's own tensor */
    if ((a->state = pi_state_own(mod, a->mv)) == NULL)
        Py_RETURN_NONE;
    PyObject *c[13] = {cache, a->swa, a->mamba, a->plan, a->value, a->units, a->ek, a->prev,
                       a->e_o, a->n_o, a->total_o, a->state, a->ps_o};
    return pi_stamp_walk(mod, cache, a, core_pair_insert, c, 13);
}

static PyObject *
core_pair_insert_api(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    return pi_entry(mod, args, nargs, "pair_insert_api", s_pi_pair_insert, pi_pair_rest);
}

/* one_insert's and pair_insert's work; args: (cache, swa, plan, value, units, extra_key,
 * prev, e, n, total, prepared, direct, page_size). */
static PyObject *
ci_insert(PyObject *mod, PyObject *cache, const CiShape *sh, PyObject *const *args)
{
    PyObject *swa = args[1], *plan = args[2], *value = args[3], *units = args[4], *ek = args[5],
             *prepared = args[10];
    int is_swa = swa != Py_None, direct = args[11] == Py_True, pair = sh->nc == 2;
    static const int ints[5] = {6, 7, 8, 9, 12};
    Py_ssize_t iv[5];
    if (!ci_ints(args, ints, 5, iv))
        Py_RETURN_NONE;
    Py_ssize_t prev = iv[0], e = iv[1], n = iv[2], total = iv[3], ps = iv[4];
    if (g_pn_type == NULL || g_InsertResult == NULL || !PyList_CheckExact(plan) || ps < 1)
        Py_RETURN_NONE;
    Py_ssize_t np = PyList_GET_SIZE(plan);
    for (Py_ssize_t i = 0; i < np; i++) {
        PyObject *it = PyList_GET_ITEM(plan, i);
        if (!PyTuple_CheckExact(it) || PyTuple_GET_SIZE(it) != 2
                || !PyLong_CheckExact(PyTuple_GET_ITEM(it, 1)))
            Py_RETURN_NONE;
        if (pair) {  /* (the general path's unevict for a node without Full data) */
            PyObject *c = PyTuple_GET_ITEM(it, 0);
            if (!PN_IS(c) || SLOT_AT(c, PN_value) == NULL || IS_NONE(SLOT_AT(c, PN_value)))
                Py_RETURN_NONE;
        }
    }
    KeyView uk;
    if (key_view(units, &uk) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t un = uk.n;
    key_release(&uk);
    if (un != n)
        Py_RETURN_NONE;

    PyObject *ev = NULL, *vs = NULL, *deferred = NULL, *heap = NULL, *lru = NULL,
             *heads[2] = {NULL, NULL}, *root = NULL, *node = NULL, *child = NULL, *rec = NULL,
             *both = NULL, *result = NULL;
    long long clock = 0;
    int started = 0;
    if ((ev = PyObject_GetAttr(cache, s_events)) == NULL
            || (vs = PyObject_GetAttr(cache, s_validate)) == NULL
            || (deferred = PyObject_GetAttr(cache, s_ci_deferred)) == NULL
            || (heap = PyObject_GetAttr(cache, s_heap)) == NULL)
        goto fail;
    for (int j = 0; j < sh->nc; j++) {
        Py_XSETREF(lru, PyObject_GetAttr(sh->comp[j], s_lru));
        if (lru == NULL || (heads[j] = PyObject_GetAttr(lru, s_head)) == NULL)
            goto fail;
    }
    if ((root = PyObject_GetAttr(cache, s_root_node)) == NULL)
        goto fail;
    int vtrue = PyObject_IsTrue(vs);
    if (vtrue < 0)
        goto fail;
    if ((direct && !PyList_CheckExact(deferred)) || !PyList_CheckExact(heap)) {
        result = Py_NewRef(Py_None);  /* the Python loop's: nothing changed */
        goto done;
    }
    if (ci_clock_in(cache, &clock) < 0)
        goto fail;
    started = 1;

    /* the walk (``_touch`` of each planned node, its split, overlap and duplicates) */
    node = Py_NewRef(root);
    Py_ssize_t pos = 0;
    for (Py_ssize_t i = 0; i < np; i++) {
        PyObject *it = PyList_GET_ITEM(plan, i);
        Py_ssize_t shared = PyLong_AsSsize_t(PyTuple_GET_ITEM(it, 1));
        if (shared == -1 && PyErr_Occurred())
            goto fail;
        Py_XSETREF(child, Py_NewRef(PyTuple_GET_ITEM(it, 0)));
        clock += g_stride;
        PyObject *stamp = PyLong_FromLongLong(clock);
        if (stamp == NULL)
            goto fail;
        if (PN_SET(child, last_access_time, stamp) < 0) {
            Py_DECREF(stamp);
            goto fail;
        }
        int leaf = pn_unlocked_leaf(child);
        if (leaf < 0 || (leaf && pn_heap_push(heap, stamp, child) < 0)) {
            Py_DECREF(stamp);
            goto fail;
        }
        Py_DECREF(stamp);
        for (int j = 0; j < sh->nc; j++) {  /* (each record to the front, component order) */
            Py_XSETREF(rec, pn_rec_at(child, sh->idx[j]));
            int has = rec == NULL ? -1 : rec_holds(rec);
            if (has < 0 || (has && lru_move_after(heads[j], rec) < 0))
                goto fail;
        }
        Py_ssize_t klen = pn_key_len(child);
        if (klen < 0)
            goto fail;
        if (shared < klen) {
            PyObject *up = ci_call2(cache, cache, s_split_m, child, shared, &clock);
            if (up == NULL)
                goto fail;
            Py_SETREF(child, up);
        }
        Py_ssize_t end = pos + shared, taken = shared;
        /* a locked SWA tombstone keeps its slots (another holder reads them; docs/SPEC.md) */
        if (is_swa && prev < end) {
            Py_XSETREF(rec, pn_rec_at(child, sh->idx[sh->swa_at]));
            int held = rec == NULL ? -1 : rec_holds(rec);
            int free_ = held < 0 ? -1 : held ? 0 : PN_ZERO(child, lock_ref);
            if (free_ < 0)
                goto fail;
            if (free_) {
                if (ci_clock_out(cache, clock) < 0)
                    goto fail;
                PyObject *a[7];
                PyObject *o_pos = PyLong_FromSsize_t(pos), *o_sh = PyLong_FromSsize_t(shared);
                PyObject *t = NULL;
                if (o_pos != NULL && o_sh != NULL) {
                    a[0] = swa; a[1] = child; a[2] = o_pos; a[3] = o_sh; a[4] = value;
                    a[5] = args[6]; a[6] = args[7];
                    t = PyObject_VectorcallMethod(s_ci_overlap, a,
                                                  7 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
                }
                Py_XDECREF(o_pos);
                Py_XDECREF(o_sh);
                if (t == NULL)
                    goto fail;
                taken = PyLong_AsSsize_t(t);
                Py_DECREF(t);
                if ((taken == -1 && PyErr_Occurred()) || ci_clock_in(cache, &clock) < 0)
                    goto fail;
            }
        }
        Py_ssize_t lo = prev > pos ? prev : pos;
        if (lo < pos + taken) {  /* this node's duplicates: one piece per node */
            PyObject *piece = ci_slice(value, lo, pos + taken);
            if (piece == NULL)
                goto fail;
            int r;
            if (direct) {
                r = PyList_Append(deferred, piece);
            } else {
                PyObject *a[2] = {cache, piece};
                r = discard(PyObject_VectorcallMethod(s_ci_free_m, a,
                                                      2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL));
            }
            Py_DECREF(piece);
            if (r < 0)
                goto fail;
        }
        Py_SETREF(node, child);
        child = NULL;
        pos = end;
    }

    /* the new leaf */
    PyObject *target = node;  /* (borrowed from node) */
    int is_new = 0, exist = 0;
    if (pos < n) {
        if (is_swa && e >= n) {  /* (``skips_leaf``: wholly outside the window) */
            PyObject *piece = ci_slice(value, pos, n);
            if (piece == NULL)
                goto fail;
            PyObject *a[2] = {cache, piece};
            int r = discard(PyObject_VectorcallMethod(s_ci_free_m, a,
                                                      2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL));
            Py_DECREF(piece);
            if (r < 0)
                goto fail;
            if (ci_clock_out(cache, clock) < 0)
                goto fail;
            started = 0;
            result = ci_result(pos, 0, pair);  /* (the pair: mamba_exist, as the general path) */
            goto done;
        }
        clock += g_stride;
        PyObject *rest = NULL, *ck = NULL, *full = NULL, *stamp = NULL, *leaf = NULL,
                 *nrec = NULL, *nrec2 = NULL, *tup = NULL, *children = NULL;
        int ok = 0;
        PyObject *o_pos = PyLong_FromSsize_t(pos), *o_len = PyLong_FromSsize_t(n - pos);
        if (o_pos == NULL || o_len == NULL)
            goto leaf_done;
        PyObject *sl = PySlice_New(o_pos, NULL, NULL);
        if (sl == NULL)
            goto leaf_done;
        rest = PyObject_GetItem(units, sl);
        Py_DECREF(sl);
        if (rest == NULL)
            goto leaf_done;
        if (ps == 1) {
            ck = PySequence_GetItem(rest, 0);
        } else {
            PyObject *pg = PySequence_GetSlice(rest, 0, ps);
            ck = pg == NULL ? NULL : PySequence_Tuple(pg);
            Py_XDECREF(pg);
        }
        if (ck == NULL)
            goto leaf_done;
        if (ek != Py_None) {
            PyObject *pair = PyTuple_Pack(2, ek, ck);
            Py_SETREF(ck, pair);
            if (ck == NULL)
                goto leaf_done;
        }
        /* the Full slots (a copy) and, where the window starts at or before the leaf, its
         * SWA slots over sglang's map in one pass (swa_leaf) */
        if (is_swa && e <= pos) {
            PyObject *mp = PyObject_GetAttr(swa, s_ci_map_pool);
            if (mp == NULL)
                goto leaf_done;
            if (mp != Py_None) {
                /* (through the module's attribute, as the Python function calls it) */
                PyObject *mapping = PyObject_GetAttr(mp, s_mapping);
                PyObject *fn = mapping == NULL ? NULL : PyObject_GetAttr(mod, s_ci_swa_leaf);
                if (fn != NULL) {
                    PyObject *a[4] = {value, o_pos, o_len, mapping};
                    both = PyObject_Vectorcall(fn, a, 4, NULL);
                    Py_DECREF(fn);
                }
                Py_XDECREF(mapping);
                if (both == NULL) {
                    Py_DECREF(mp);
                    goto leaf_done;
                }
                if (both == Py_None)
                    Py_CLEAR(both);
            }
            Py_DECREF(mp);
        }
        full = both == NULL ? narrow_copy(value, pos, n - pos) : PySequence_GetItem(both, 0);
        if (full == NULL || (stamp = PyLong_FromLongLong(clock)) == NULL)
            goto leaf_done;
        PyObject *na[6] = {rest, full, node, ek, stamp, ck};
        leaf = PyObject_Vectorcall((PyObject *)g_pn_type, na, 6, NULL);
        if (leaf == NULL)
            goto leaf_done;
        if ((nrec = PyObject_CallOneArg((PyObject *)g_ad_type, leaf)) == NULL
                || (pair && (nrec2 = PyObject_CallOneArg((PyObject *)g_ad_type, leaf)) == NULL)
                || (tup = pair ? PyTuple_Pack(2, nrec, nrec2) : PyTuple_Pack(1, nrec)) == NULL
                || PN_SET(leaf, aux, tup) < 0
                || (children = PN_GET(node, children)) == NULL
                || PyObject_SetItem(children, ck, leaf) < 0)
            goto leaf_done;
        if (pyfield_add(node, PN_OFF(node, PN_dev_children), s_dev_children, 1) < 0
                || pyfield_add(cache, 0, s_evictable, (long long)(n - pos)) < 0)
            goto leaf_done;
        int r;
        if (vtrue) {  /* (``_own``: the slot ledger takes the leaf's slots) */
            PyObject *owned = PyObject_GetAttr(cache, s_owned);
            PyObject *lv = owned == NULL ? NULL : PN_GET(leaf, value);
            PyObject *lst = lv == NULL ? NULL : PyObject_CallMethodNoArgs(lv, s_tolist);
            r = lst == NULL ? -1 : discard(PyObject_CallMethodOneArg(owned, s_update, lst));
            Py_XDECREF(owned);
            Py_XDECREF(lv);
            Py_XDECREF(lst);
            if (r < 0)
                goto leaf_done;
        }
        PyObject *lt = PN_GET(leaf, last_access_time);
        if (lt == NULL)
            goto leaf_done;
        r = pn_heap_push(heap, lt, leaf);  /* (a new leaf: unlocked, no children) */
        Py_DECREF(lt);
        if (r < 0)
            goto leaf_done;
        if (ev != Py_None) {  /* (KV events: the new leaf is stored) */
            PyObject *a[2] = {ev, leaf};
            if (discard(PyObject_VectorcallMethod(s_ci_stored, a,
                                                  2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL)) < 0)
                goto leaf_done;
        }
        ok = 1;
    leaf_done:
        Py_XDECREF(o_pos);
        Py_XDECREF(o_len);
        Py_XDECREF(rest);
        Py_XDECREF(ck);
        Py_XDECREF(full);
        Py_XDECREF(stamp);
        Py_XDECREF(nrec);
        Py_XDECREF(nrec2);
        Py_XDECREF(tup);
        Py_XDECREF(children);
        if (!ok) {
            Py_XDECREF(leaf);
            goto fail;
        }
        Py_SETREF(node, leaf);  /* (node holds the target from here) */
        target = node;
        is_new = 1;
    }

    /* each component's commit, in component order */
    for (int j = 0; j < sh->nc; j++) {
    PyObject *comp = sh->comp[j], *head = heads[j];
    if (j == sh->swa_at) {  /* (``SwaComponent.commit``) */
        Py_ssize_t tk = is_new ? pn_key_len(target) : 0;
        if (tk < 0)
            goto fail;
        if (is_new && e - pos < tk) {
            if (e - pos > 0) {
                PyObject *up = ci_call2(cache, cache, s_split_m, target, e - pos, &clock);
                if (up == NULL)
                    goto fail;
                Py_DECREF(up);
            }
            Py_XSETREF(rec, pn_rec_at(target, sh->idx[j]));  /* (``AuxComponent.set``) */
            if (rec == NULL)
                goto fail;
            PyObject *sv;
            if (both != NULL) {
                sv = PySequence_GetItem(both, 1);
            } else {
                PyObject *tv = PN_GET(target, value);
                if (tv == NULL)
                    goto fail;
                PyObject *a[2] = {comp, tv};
                sv = PyObject_VectorcallMethod(s_ci_translate, a,
                                               2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
                Py_DECREF(tv);
            }
            if (sv == NULL)
                goto fail;
            int r = AD_SET(rec, value, sv);
            Py_DECREF(sv);
            if (r < 0 || lru_link_after(head, rec) < 0)
                goto fail;
            if ((tk = pn_key_len(target)) < 0 || pyfield_add(comp, 0, s_comp_evictable, tk) < 0)
                goto fail;
        }
    } else {
        Py_XSETREF(rec, pn_rec_at(target, sh->idx[j]));
        int held = rec == NULL ? -1 : rec_holds(rec);
        if (held < 0)
            goto fail;
        if (is_new || !held) {  /* (``MambaComponent.commit``, ``AuxComponent.set``) */
            if (AD_SET(rec, value, prepared) < 0 || lru_link_after(head, rec) < 0)
                goto fail;
            PyObject *lk = AD_GET(rec, lock);
            if (lk == NULL)
                goto fail;
            int locked = PyObject_IsTrue(lk);
            Py_DECREF(lk);
            if (locked < 0 || pyfield_add(comp, 0, locked ? s_comp_protected : s_comp_evictable,
                                          1) < 0)
                goto fail;
            PyObject *tr = PyObject_GetAttr(comp, s_ci_tracks);
            if (tr == NULL)
                goto fail;
            int tracks = PyObject_IsTrue(tr);
            Py_DECREF(tr);
            if (tracks < 0)
                goto fail;
            if (tracks) {
                PyObject *a[2] = {comp, prepared};
                if (discard(PyObject_VectorcallMethod(s_ci_on_set, a,
                                                      2 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                                      NULL)) < 0)
                    goto fail;
            }
        } else {
            if (lru_move_after(head, rec) < 0)
                goto fail;
            exist = 1;
        }
        if (!is_new) {  /* (``cache._stamp(target)``) */
            if (ci_clock_out(cache, clock) < 0)
                goto fail;
            PyObject *a[2] = {cache, target};
            if (discard(PyObject_VectorcallMethod(s_ci_stamp_m, a,
                                                  2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL)) < 0
                    || ci_clock_in(cache, &clock) < 0)
                goto fail;
        }
    }
    }
    if (ci_clock_out(cache, clock) < 0)
        goto fail;
    started = 0;
    if (direct && PyList_GET_SIZE(deferred)) {
        /* ``insert``'s release of its queue, written here (see the Python function); where
         * the native frees decline (nothing changed) the pieces stay queued for ``insert`` */
        PyObject *alloc = PyObject_GetAttr(cache, s_alloc);
        PyObject *done = alloc == NULL ? NULL : core_native_release_own(alloc, deferred);
        Py_XDECREF(alloc);
        if (done == NULL) {
            if (alloc != NULL) {  /* (tried once, as ``insert``'s release would have) */
                PyObject *et, *evv, *tb;
                PyErr_Fetch(&et, &evv, &tb);
                keep_error(et, evv, tb,
                           PyList_SetSlice(deferred, 0, PyList_GET_SIZE(deferred), NULL));
            }
            goto fail;
        }
        int yes = done == Py_True;
        Py_DECREF(done);
        if (yes && PyList_SetSlice(deferred, 0, PyList_GET_SIZE(deferred), NULL) < 0)
            goto fail;
    }
    result = ci_result(pos, total, exist);
    goto done;
fail:
    if (started)
        write_back(cache, s_clock, clock);
    result = NULL;
done:
    Py_XDECREF(ev);
    Py_XDECREF(vs);
    Py_XDECREF(deferred);
    Py_XDECREF(heap);
    Py_XDECREF(lru);
    Py_XDECREF(heads[0]);
    Py_XDECREF(heads[1]);
    Py_XDECREF(root);
    Py_XDECREF(node);
    Py_XDECREF(child);
    Py_XDECREF(rec);
    Py_XDECREF(both);
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* composed tree: one_insert_api                                                               */
/* ------------------------------------------------------------------------------------------ */
/*
 * one_insert_api(cache, params) -> InsertResult, or None (nothing changed): fast/one_aux.py
 * insert_one whole for one stock aux component, SWA or Mamba, without a host tier (the
 * cache's ``_insert_fast``, called by fast/hybrid.py ``insert``, which releases the queued
 * frees), in insert_one's order: the key read in place, the argument checks, the cut to whole
 * pages and the plan (pi_read, as pair_insert_api), then the component's checks as insert_one
 * writes them out (SWA: swa_evicted_seqlen an int >= 0 of whole pages, no mamba_value, and
 * where prev_prefix_len > 0 check_insert's loop; Mamba: swa_evicted_seqlen 0 and
 * mamba_state's checks and copy), the root's stamp, the answer for no whole page, and
 * one_insert's walk, leaf, commit and (Mamba inside ``insert``) the queue's release.
 * Where insert_one would raise, return None, or do anything this does not write out (a bigram
 * or EAGLE key, list token ids, the slot ledger, a disabled cache, KV events, a tier, a policy
 * order, the cache's ``_one_insert`` off: a hook of its own; a non-exact int or tensor, a
 * non-list queue), it declines before changing anything: insert_one then runs from its start
 * with its own checks and messages.  The value goes to one_insert uncut, as pair_insert_api
 * passes it (only value[0:n] is read: the same views and copies).
 * tests/fast/test_one_insert_api.py runs this against insert_one in lockstep.
 */
static PyObject *s_oi_flag;

static PyObject *
oi_rest(PyObject *mod, PyObject *cache, PyObject *params, PiArgs *a)
{
    if ((a->swa = PyObject_GetAttr(cache, s_pi_swa)) == NULL
            || (a->comps = PyObject_GetAttr(cache, s_cm_components)) == NULL
            || !PyTuple_CheckExact(a->comps) || PyTuple_GET_SIZE(a->comps) != 1)
        Py_RETURN_NONE;
    int direct = 0;
    if (a->swa != Py_None) {  /* (``_check_aux`` with ``SwaComponent.check_insert``, inlined) */
        if (!pi_count(a->e_o, &a->e) || a->e % a->ps
                || (a->mv = PyObject_GetAttr(params, s_pi_mamba_value)) == NULL
                || a->mv != Py_None)
            Py_RETURN_NONE;
        if (a->prev_n && pi_swa_refuses(a->plan, a->prev_n, a->e, 0) != 0)
            Py_RETURN_NONE;
    } else {  /* (Mamba: the setting, then mamba_state's checks) */
        if (!pi_count(a->e_o, &a->e) || a->e != 0 || !pi_state_arg(params, &a->mv))
            Py_RETURN_NONE;
        /* inside ``insert`` the duplicates are queued and released at the end */
        if ((a->deferred = PyObject_GetAttr(cache, s_ci_deferred)) == NULL
                || (a->deferred != Py_None && !PyList_CheckExact(a->deferred)))
            Py_RETURN_NONE;
        direct = a->deferred != Py_None;
    }
    if (!pi_ready(cache, a))
        Py_RETURN_NONE;
    /* mamba_state's copy (Mamba), else no state */
    a->state = a->swa != Py_None ? Py_NewRef(Py_None) : pi_state_own(mod, a->mv);
    if (a->state == NULL)
        Py_RETURN_NONE;
    PyObject *c[14] = {cache, PyTuple_GET_ITEM(a->comps, 0), a->swa, a->plan, a->value,
                       a->units, a->ek, a->prev, a->e_o, a->n_o, a->total_o, a->state,
                       direct ? Py_True : Py_False, a->ps_o};
    return pi_stamp_walk(mod, cache, a, core_one_insert, c, 14);
}

static PyObject *
core_one_insert_api(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    return pi_entry(mod, args, nargs, "one_insert_api", s_oi_flag, oi_rest);
}

/* one_plan(root, units, extra_key, page_size, step) -> [(node, shared units), ...]: fast/cache.py
 * _plan (the whole walk of an insert, before anything changes) from root, one step per node
 * through step (keys.match_step: this module's match_step called directly when it is that
 * function, else called as Python calls it), each pair a new tuple as the Python loop makes. */
static PyObject *
core_one_plan(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(5, "one_plan(root, units, extra_key, page_size, step)");
    PyObject *units = args[1], *ek = args[2], *ps = args[3], *step = args[4];
    int native = PyCFunction_Check(step) && ((PyCFunctionObject *)step)->m_ml->ml_meth
        == (PyCFunction)(void (*)(void))core_match_step;
    Py_ssize_t n = PyObject_Size(units);
    if (n < 0)
        return NULL;
    PyObject *n_o = PyLong_FromSsize_t(n), *plan = n_o == NULL ? NULL : PyList_New(0);
    PyObject *node = Py_NewRef(args[0]), *pos = Py_NewRef(s_zero), *r = NULL;
    if (plan == NULL)
        goto fail;
    for (;;) {
        int more = PyObject_RichCompareBool(pos, n_o, Py_LT);
        if (more < 0)
            goto fail;
        if (!more)
            break;
        PyObject *children = PN_GET(node, children);
        if (children == NULL)
            goto fail;
        PyObject *a[6] = {children, units, pos, n_o, ps, ek};
        r = native ? core_match_step(NULL, a, 6) : PyObject_Vectorcall(step, a, 6, NULL);
        Py_DECREF(children);
        if (r == NULL)
            goto fail;
        if (!PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) != 3) {  /* (unpacked as Python) */
            PyObject *t = PySequence_Tuple(r);
            Py_SETREF(r, t);
            if (r == NULL)
                goto fail;
            if (PyTuple_GET_SIZE(r) != 3) {
                PyErr_Format(PyExc_ValueError, PyTuple_GET_SIZE(r) > 3
                             ? "too many values to unpack (expected 3)"
                             : "not enough values to unpack (expected 3, got %zd)",
                             PyTuple_GET_SIZE(r));
                goto fail;
            }
        }
        PyObject *child = PyTuple_GET_ITEM(r, 0), *k = PyTuple_GET_ITEM(r, 1);
        if (child == Py_None)
            break;
        PyObject *pair = PyTuple_Pack(2, child, k);
        if (pair == NULL)
            goto fail;
        int ok = PyList_Append(plan, pair);
        Py_DECREF(pair);
        if (ok < 0)
            goto fail;
        int split = PyObject_IsTrue(PyTuple_GET_ITEM(r, 2));
        if (split < 0)
            goto fail;
        if (split)
            break;
        PyObject *next = PyNumber_Add(pos, k);
        if (next == NULL)
            goto fail;
        Py_SETREF(pos, next);
        Py_SETREF(node, Py_NewRef(child));
        Py_CLEAR(r);
    }
    Py_XDECREF(r);
    Py_DECREF(node);
    Py_DECREF(pos);
    Py_DECREF(n_o);
    return plan;
fail:
    Py_XDECREF(r);
    Py_DECREF(node);
    Py_DECREF(pos);
    Py_XDECREF(n_o);
    Py_XDECREF(plan);
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* ---- host tier: Full match, locks, acks (host_match, host_inc, host_dec) ---- */
/* ------------------------------------------------------------------------------------------ */
/*
 * fast/host_full.py's paths for the Full component alone over the host tier (the composed tree
 * with no aux component, the lru order, plain keys), and the host tier's ack processing for
 * that shape (fast/tiers/host.py), the same steps in the same order with the same results:
 *  - host_match(cache, units, extra_key, n): match_host after its key (fast/host_full.py
 *    match_key): the walk down (match_step's step; a split through the cache's own _split,
 *    the walk's last step), the device part (torch.cat), _stamp_tiered_path's stamps (a device node that
 *    may be a leaf pushed on the heap, an evicted one re-entered on the host heap where it is
 *    a host leaf: HostTier.restamped, inline for the stock tier), host_hit, the MatchResult;
 *  - host_inc(cache, node): inc_lock_host (the evicted bottom skipped and remembered, the
 *    anchor, lock_walk, the counters, the HostIncLockRefResult);
 *  - host_dec(cache, node, params): dec_lock_host with HostTier._full_write_unlock;
 *    host_unlock(cache, anchor): _full_write_unlock alone (every node from the anchor up
 *    checked first: HandleError with nothing changed; then one lock less each, a node
 *    reaching 0 pushed where it is an evictable leaf, in the walk's order);
 *  - host_writing(tier): HostTier.writing_check(write_back=False) where every ack of the done
 *    prefix is an Ack with an _Event and there is no tp_group, KV events, storage tier or aux
 *    component: each ack off the queue, each of its ids popped from ongoing_write_through and
 *    its lock's anchor unlocked as _full_write_unlock does.
 * Each reads and checks everything it decides on before its first change and answers None
 * (nothing changed) where it does not write the case out: the Python function then runs.  Their
 * callers call them only where the cache has fast/host_full.py's paths (the stock hooks, no
 * eviction policy key).  tests/fast/test_host_lock_twins.py runs them against the Python paths.
 */

static PyObject *g_hl_tier, *g_hl_lazy_heap, *g_hl_inc_result, *g_hl_dec_result,
    *g_hl_dec_params, *g_hl_event, *g_hl_ack, *g_hl_in_flight;
static PyObject *s_hl_tier, *s_hl_host_leaves, *s_hl_host_leaf_heap, *s_hl_entries,
    *s_hl_restamped, *s_hl_anchor, *s_hl_delta, *s_hl_skip, *s_hl_cache, *s_hl_done,
    *s_hl_controller, *s_hl_queue, *s_hl_tp_group, *s_hl_storage, *s_hl_components,
    *s_hl_ongoing, *s_hl_host_value, *s_hl_host_hit;

/* host_setup(HostTier, LazyHeap, HostIncLockRefResult, DecLockRefResult, HostDecLockRefParams,
 * _Event, Ack, InFlight): the classes the twins check objects against and build. */
static PyObject *
core_host_setup(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(8, "host_setup(HostTier, LazyHeap, HostIncLockRefResult, "
         "DecLockRefResult, HostDecLockRefParams, _Event, Ack, InFlight)");
    for (int i = 0; i < 8; i++)
        if (!PyType_Check(args[i])) {
            PyErr_SetString(PyExc_TypeError, "host_setup: eight classes");
            return NULL;
        }
    static const char *names[] = {"tier", "host_leaves", "host_leaf_heap", "entries",
        "restamped", "anchor", "delta", "skip_lock_node_ids", "cache", "done", "controller",
        "ack_write_queue", "tp_group", "storage", "components", "ongoing_write_through",
        "host_value", "host_hit"};
    PyObject **svars[] = {&s_hl_tier, &s_hl_host_leaves, &s_hl_host_leaf_heap, &s_hl_entries,
        &s_hl_restamped, &s_hl_anchor, &s_hl_delta, &s_hl_skip, &s_hl_cache, &s_hl_done,
        &s_hl_controller, &s_hl_queue, &s_hl_tp_group, &s_hl_storage, &s_hl_components,
        &s_hl_ongoing, &s_hl_host_value, &s_hl_host_hit};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (*svars[i] == NULL && (*svars[i] = PyUnicode_InternFromString(names[i])) == NULL)
            return NULL;
    PyObject **dst[8] = {&g_hl_tier, &g_hl_lazy_heap, &g_hl_inc_result, &g_hl_dec_result,
                         &g_hl_dec_params, &g_hl_event, &g_hl_ack, &g_hl_in_flight};
    for (int i = 0; i < 8; i++)
        Py_XSETREF(*dst[i], Py_NewRef(args[i]));
    Py_RETURN_NONE;
}

/* The twins' common start: the classes set up and the composed tree's offsets read. */
#define HL_READY() (g_hl_tier != NULL && g_pn_type != NULL && g_ck_inc_result != NULL)

/* What a stamped evicted node's HostTier.restamped needs, read once: where the tier is exactly
 * HostTier with a set of host leaves and a LazyHeap, *leaves and *entries (its list) as new
 * references; else both NULL (the tier's own method is called).  0 or -1. */
static int
hl_host_heap(PyObject *tier, PyObject **leaves, PyObject **entries)
{
    *leaves = *entries = NULL;
    if ((PyObject *)Py_TYPE(tier) != g_hl_tier)
        return 0;
    PyObject *hl = PyObject_GetAttr(tier, s_hl_host_leaves), *lh = NULL, *e = NULL;
    if (hl == NULL)
        return -1;
    if (PyAnySet_CheckExact(hl) && (lh = PyObject_GetAttr(tier, s_hl_host_leaf_heap)) != NULL
            && (PyObject *)Py_TYPE(lh) == g_hl_lazy_heap
            && (e = PyObject_GetAttr(lh, s_hl_entries)) != NULL && PyList_CheckExact(e)) {
        *leaves = hl;
        *entries = e;
        Py_DECREF(lh);
        return 0;
    }
    Py_DECREF(hl);
    Py_XDECREF(lh);
    Py_XDECREF(e);
    return PyErr_Occurred() ? -1 : 0;
}

/* HostTier.restamped(node), node's stamp just set to stamp: `if node in host_leaves:
 * host_leaf_heap.push(node.last_access_time, node)` inline (entries not NULL), else the
 * tier's method.  0 or -1. */
static int
hl_restamped(PyObject *tier, PyObject *leaves, PyObject *entries, PyObject *node,
             PyObject *stamp)
{
    if (entries == NULL)
        return discard(PyObject_CallMethodOneArg(tier, s_hl_restamped, node));
    int in = PySet_Contains(leaves, node);
    if (in <= 0)
        return in;
    return pn_heap_push(entries, stamp, node);
}

/* The record's value and host_value (aux data on the device, on the host) as two flags: 0, or
 * -1 with the error set. */
static int
hm_rec_flags(PyObject *rec, int *dev, int *host)
{
    PyObject *v = AD_GET(rec, value);
    if (v == NULL)
        return -1;
    *dev = v != Py_None;
    Py_DECREF(v);
    if ((v = pyfield_get(rec, AD_OFF(rec, AD_host_value), s_hl_host_value)) == NULL)
        return -1;
    *host = v != Py_None;
    Py_DECREF(v);
    return 0;
}

/* host_match(cache, units, extra_key, n[, comp, is_swa, window]) -> match_host's MatchResult
 * after its key, or None.  With the three last arguments, fast/host_aux.py match_host_aux's
 * for one stock aux component (its record node.aux[0]): both validators on every node of the
 * walk (SWA: runs of window units of data on the device or the host, restarted at a node with
 * neither; Mamba: a state on the device or the host), the match's node the deepest the host
 * validator accepts and its device part the deepest node with device data the device
 * validator accepts (the indices are that part's chunks); then the component's list moves
 * (path_to_front: each record holding data, from the node up, to the front in turn), the
 * stamps from the node, the component's host hit (SWA: comp.host_hit(node); Mamba: a state
 * on the host only) and the tier's. */
static PyObject *
core_host_match(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "host_match(cache, units, extra_key, n[, comp, is_swa, window])");
        return NULL;
    }
    if (!HL_READY() || g_MatchResult == NULL || g_cat == NULL || !PyLong_CheckExact(args[3]))
        Py_RETURN_NONE;
    PyObject *cache = args[0], *ek = args[2];
    Py_ssize_t n = PyLong_AsSsize_t(args[3]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    PyObject *comp = nargs == 7 ? args[4] : NULL;
    int is_swa = 0;
    long long window = 0;
    if (comp != NULL) {
        int ovw = 0;
        if (!PyBool_Check(args[5]) || !PyLong_CheckExact(args[6]))
            Py_RETURN_NONE;
        is_swa = args[5] == Py_True;
        window = PyLong_AsLongLongAndOverflow(args[6], &ovw);
        if (ovw || (window == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
    }
    KeyView uk, kv;
    uk.held = kv.held = 0;
    PyObject *root = NULL, *heap = NULL, *tier = NULL, *leaves = NULL, *entries = NULL;
    PyObject *chunks = NULL, *node = NULL, *last = NULL, *indices = NULL, *cur = NULL;
    PyObject *v = NULL, *stamp = NULL, *hit = NULL, *result = NULL;
    PyObject *best = NULL, *best_dev = NULL, *rec = NULL, *lru = NULL, *prev = NULL;
    PyObject *aux_hit = NULL;
    Py_ssize_t best_chunks = 0;
    long long host_run = 0, dev_run = 0;
    int host_inf = 1, dev_inf = 1;  /* (the runs start at infinity: the root's window) */
    int swa_hit_set = 0, mamba_hit = 0;
    int declined = 0, ovf = 0;
    /* every read the walk decides on, before its first change */
    if ((root = PyObject_GetAttr(cache, s_root_node)) == NULL)
        goto done;
    PyObject *pso = PyObject_GetAttr(cache, s_page_size);
    if (pso == NULL)
        goto done;
    long long ps = PyLong_CheckExact(pso) ? PyLong_AsLongLongAndOverflow(pso, &ovf) : 0;
    Py_DECREF(pso);
    if (!PN_IS(root) || ps < 1 || ovf || n < 1 || n % ps) {
        declined = 1;
        goto done;
    }
    if ((heap = PyObject_GetAttr(cache, s_heap)) == NULL
            || (tier = PyObject_GetAttr(cache, s_hl_tier)) == NULL
            || hl_host_heap(tier, &leaves, &entries) < 0)
        goto done;
    PyObject *clk = PyObject_GetAttr(cache, s_clock);  /* (stamped as an int below) */
    if (clk == NULL)
        goto done;
    int clock_ok = PyLong_CheckExact(clk);
    Py_DECREF(clk);
    if (!clock_ok || !PyList_CheckExact(heap) || key_view(args[1], &uk) < 0 || uk.n < n) {
        PyErr_Clear();
        declined = 1;
        goto done;
    }
    /* the walk down: through device nodes and evicted ones with a host copy, reading only
     * until its last step's split */
    if ((chunks = PyList_New(0)) == NULL)
        goto done;
    node = Py_NewRef(root);
    last = Py_NewRef(root);
    best = Py_NewRef(root);
    best_dev = Py_NewRef(root);
    Py_ssize_t pos = 0;
    while (pos < n) {
        PyObject *children = SLOT_AT(node, PN_children);
        if (children == NULL || !PyDict_CheckExact(children)) {
            declined = 1;
            goto done;
        }
        PyObject *child = cm_child(children, uk.p, pos, (Py_ssize_t)ps, ek);  /* borrowed */
        if (child == NULL) {
            if (PyErr_Occurred())
                goto done;
            break;
        }
        if (!PN_IS(child) || SLOT_AT(child, PN_value) == NULL || SLOT_AT(child, PN_key) == NULL
                || SLOT_AT(child, PN_host_value) == NULL) {
            declined = 1;
            goto done;
        }
        Py_INCREF(child);
        if (key_view(SLOT_AT(child, PN_key), &kv) < 0) {
            PyErr_Clear();
            Py_DECREF(child);
            declined = 1;
            goto done;
        }
        Py_ssize_t k = kv.n;
        int split = !(pos + k <= n && memcmp(uk.p + pos, kv.p, (size_t)k * sizeof(long long)) == 0);
        if (split)
            k = shared_pages(kv.p, kv.n, uk.p + pos, n - pos, (Py_ssize_t)ps);
        key_release(&kv);
        if (SLOT_AT(child, PN_value) == Py_None && SLOT_AT(child, PN_host_value) == Py_None) {
            Py_DECREF(child);  /* evicted without a host copy: the walk ends above it */
            break;
        }
        if (split) {  /* child = cache._split(child, k): the walk's one change, its last step */
            PyObject *ko = PyLong_FromSsize_t(k);
            PyObject *upper = ko == NULL ? NULL
                : PyObject_CallMethodObjArgs(cache, s_split_m, child, ko, NULL);
            Py_XDECREF(ko);
            Py_DECREF(child);
            if (upper == NULL)
                goto done;
            child = upper;
        }
        if ((v = PN_GET(child, value)) == NULL) {
            Py_DECREF(child);
            goto done;
        }
        int has_value = v != Py_None;
        if (has_value) {  /* chunks.append(value); last_device = child */
            if (PyList_Append(chunks, v) < 0) {
                Py_DECREF(child);
                goto done;
            }
            Py_SETREF(last, Py_NewRef(child));
        }
        Py_CLEAR(v);
        Py_SETREF(node, child);
        pos += k;
        if (comp != NULL) {  /* the two validators on the node's record */
            int dev, host, dev_ok, to_best = 0;
            if ((rec = pn_rec_at(node, 0)) == NULL || hm_rec_flags(rec, &dev, &host) < 0)
                goto done;
            Py_CLEAR(rec);
            if (is_swa) {
                if (!dev) {
                    dev_inf = 0;
                    dev_run = 0;
                    dev_ok = 0;
                    if (!host) {
                        host_inf = 0;
                        host_run = 0;
                    } else {
                        host_run += k;
                        to_best = host_inf || host_run >= window;
                    }
                } else {
                    host_run += k;
                    to_best = host_inf || host_run >= window;
                    dev_run += k;
                    dev_ok = dev_inf || dev_run >= window;
                }
            } else if (!dev) {
                dev_ok = 0;
                to_best = host;
            } else {
                to_best = 1;
                dev_ok = 1;
            }
            if (to_best)
                Py_SETREF(best, Py_NewRef(node));
            if (dev_ok && has_value) {
                Py_SETREF(best_dev, Py_NewRef(node));
                best_chunks = PyList_GET_SIZE(chunks);
            }
        }
        if (split)
            break;
    }
    if (comp != NULL) {  /* the match is the validators' (below as node and last) */
        Py_SETREF(node, Py_NewRef(best));
        Py_SETREF(last, Py_NewRef(best_dev));
        /* (``path_to_front(node)``: LruList.move_after inlined, each record holding data) */
        if ((lru = PyObject_GetAttr(comp, s_lru)) == NULL
                || (prev = PyObject_GetAttr(lru, s_head)) == NULL)
            goto done;
        cur = Py_NewRef(node);
        while (cur != root) {
            PyObject *r = pn_rec_at(cur, 0);
            if (r == NULL || rec_to_front(&prev, r) < 0)
                goto done;
            PyObject *up = PN_GET(cur, parent);
            if (up == NULL)
                goto done;
            Py_SETREF(cur, up);
        }
        Py_CLEAR(cur);
    }
    /* (``_indices``: torch.cat as the Python function calls it; concat_values would read five
     * attributes of each tensor chunk, about twice torch.cat's cost per chunk) */
    Py_ssize_t nc = comp != NULL ? best_chunks : PyList_GET_SIZE(chunks);
    if (nc == 0) {
        indices = PyObject_GetAttr(cache, s_empty);
    } else if (nc == 1) {
        indices = Py_NewRef(PyList_GET_ITEM(chunks, 0));
    } else if (nc == PyList_GET_SIZE(chunks)) {
        indices = PyObject_CallOneArg(g_cat, chunks);
    } else {
        PyObject *part = PyList_GetSlice(chunks, 0, nc);
        indices = part == NULL ? NULL : PyObject_CallOneArg(g_cat, part);
        Py_XDECREF(part);
    }
    if (indices == NULL)
        goto done;
    /* (``_stamp_tiered_path(node)``): the node newest, each ancestor one older, the root too */
    long long clock;
    if (get_ll(cache, s_clock, &clock) < 0)
        goto done;
    clock += g_stride;
    if (set_ll(cache, s_clock, clock) < 0)
        goto done;
    cur = Py_NewRef(node);
    while (cur != root) {
        if ((stamp = PyLong_FromLongLong(clock)) == NULL || PN_SET(cur, last_access_time, stamp) < 0
                || (v = PN_GET(cur, value)) == NULL)
            goto done;
        if (v == Py_None) {
            if (hl_restamped(tier, leaves, entries, cur, stamp) < 0)
                goto done;
        } else {  /* dev_children == 0 and lock_ref == 0 and aux_lock == 0: a leaf, pushed */
            int r = PN_ZERO(cur, dev_children);
            if (r > 0)
                r = PN_ZERO(cur, lock_ref);
            if (r > 0)
                r = PN_ZERO(cur, aux_lock);
            if (r < 0 || (r > 0 && pn_heap_push(heap, stamp, cur) < 0))
                goto done;
        }
        Py_CLEAR(v);
        Py_CLEAR(stamp);
        clock -= 1;
        PyObject *up = PN_GET(cur, parent);
        if (up == NULL)
            goto done;
        Py_SETREF(cur, up);
    }
    if ((stamp = PyLong_FromLongLong(clock)) == NULL || PN_SET(root, last_access_time, stamp) < 0)
        goto done;
    if (comp != NULL && node != root) {  /* the component's host hit */
        if (is_swa) {  /* (``comp.host_hit(node)``) */
            if ((aux_hit = PyObject_CallMethodOneArg(comp, s_hl_host_hit, node)) == NULL)
                goto done;
            swa_hit_set = 1;
        } else {  /* (a state on the host only: a load back brings it) */
            int dev, host;
            if ((rec = pn_rec_at(node, 0)) == NULL || hm_rec_flags(rec, &dev, &host) < 0)
                goto done;
            Py_CLEAR(rec);
            mamba_hit = !dev && host;
        }
    }
    /* (``HostTier.host_hit(node, last_device)``): the host tokens below the device part */
    hit = Py_NewRef(s_zero);
    if (node != last) {
        Py_SETREF(cur, Py_NewRef(node));
        while (cur != last && cur != root) {
            if ((v = pyfield_get(cur, PN_OFF(cur, PN_host_value), s_hl_host_value)) == NULL)
                goto done;
            if (v != Py_None) {
                PyObject *shape = PyObject_GetAttr(v, s_shape);
                PyObject *len = shape == NULL ? NULL : PySequence_GetItem(shape, 0);
                Py_XDECREF(shape);
                if (len == NULL)
                    goto done;
                Py_SETREF(hit, PyNumber_Add(hit, len));
                Py_DECREF(len);
                if (hit == NULL)
                    goto done;
            }
            Py_CLEAR(v);
            PyObject *up = PN_GET(cur, parent);
            if (up == NULL)
                goto done;
            Py_SETREF(cur, up);
        }
    }
    PyObject *mh = PyLong_FromLong(mamba_hit);
    if (mh == NULL)
        goto done;
    PyObject *items = PyTuple_Pack(9, indices, last, node, node, hit,
                                   swa_hit_set ? aux_hit : s_zero, mh, Py_None, Py_None);
    Py_DECREF(mh);
    if (items == NULL)
        goto done;
    PyObject *targs = PyTuple_Pack(1, items);
    Py_DECREF(items);
    if (targs == NULL)
        goto done;
    result = PyTuple_Type.tp_new((PyTypeObject *)g_MatchResult, targs, NULL);
    Py_DECREF(targs);
done:
    key_release(&uk);
    key_release(&kv);
    Py_XDECREF(root);
    Py_XDECREF(heap);
    Py_XDECREF(tier);
    Py_XDECREF(leaves);
    Py_XDECREF(entries);
    Py_XDECREF(chunks);
    Py_XDECREF(node);
    Py_XDECREF(last);
    Py_XDECREF(indices);
    Py_XDECREF(cur);
    Py_XDECREF(v);
    Py_XDECREF(stamp);
    Py_XDECREF(hit);
    Py_XDECREF(best);
    Py_XDECREF(best_dev);
    Py_XDECREF(rec);
    Py_XDECREF(lru);
    Py_XDECREF(prev);
    Py_XDECREF(aux_hit);
    if (declined)
        Py_RETURN_NONE;
    return result;
}

/* host_inc(cache, node) -> inc_lock_host's HostIncLockRefResult, or None. */
static PyObject *
core_host_inc(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(2, "host_inc(cache, node)");
    if (!HL_READY())
        Py_RETURN_NONE;
    PyObject *cache = args[0], *node = args[1], *root, *cur;
    int r = ck_enter(cache, node, &root);  /* _check_attached; a disabled cache declined */
    if (r <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_None);
    for (cur = node; cur != root; cur = SLOT_AT(cur, PN_parent))  /* every node it reads */
        if (!ck_node_ok(cur, -1, 0)) {
            Py_DECREF(root);
            Py_RETURN_NONE;
        }
    PyObject *result = PyObject_CallNoArgs(g_hl_inc_result), *skipped = NULL, *skips = NULL;
    PyObject *d = NULL;
    long long delta = 0;
    if (result == NULL)
        goto fail;
    cur = node;
    if (cur != root && SLOT_AT(cur, PN_value) == Py_None) {  /* the evicted bottom, skipped */
        if ((skipped = PySet_New(NULL)) == NULL)
            goto fail;
        for (; cur != root && SLOT_AT(cur, PN_value) == Py_None; cur = SLOT_AT(cur, PN_parent))
            if (PySet_Add(skipped, SLOT_AT(cur, PN_id)) < 0)
                goto fail;
        if ((skips = PyDict_New()) == NULL || PyDict_SetItem(skips, s_zero, skipped) < 0
                || PyObject_SetAttr(result, s_hl_skip, skips) < 0)
            goto fail;
    }
    if (PyObject_SetAttr(result, s_hl_anchor, cur) < 0)
        goto fail;
    int failed = ck_full_lock(cur, root, &delta) < 0;  /* (lock_walk) */
    pyfield_add(cache, 0, s_evictable, -delta);
    if (pyfield_add(cache, 0, s_protected, delta) < 0 || failed
            || (d = PyLong_FromLongLong(delta)) == NULL
            || PyObject_SetAttr(result, s_hl_delta, d) < 0)
        goto fail;
    Py_DECREF(d);
    Py_XDECREF(skipped);
    Py_XDECREF(skips);
    Py_DECREF(root);
    return result;
fail:
    Py_XDECREF(d);
    Py_XDECREF(skipped);
    Py_XDECREF(skips);
    Py_XDECREF(result);
    Py_DECREF(root);
    return NULL;
}

/* _full_write_unlock(anchor) of a cache whose root (a Node) and heap (a list) are given: 1
 * (*delta the units unlocked), 0 to decline (nothing changed), -1 with the error (HandleError:
 * nothing changed). */
static int
hl_unlock(PyObject *cache, PyObject *root, PyObject *heap, PyObject *anchor, long long *delta)
{
    int r = ck_check_unlock(anchor, root, -1, -1, 0, NULL, NULL);  /* all checked first */
    if (r <= 0)
        return r;
    long long d = 0;
    int failed = 0;
    for (PyObject *cur = anchor; cur != root; cur = SLOT_AT(cur, PN_parent)) {
        long long x = ck_field(cur, PN_lock_ref) - 1;
        if (pyslot_set_ll(cur, PN_lock_ref, x) < 0) {
            failed = 1;
            break;
        }
        if (x == 0) {
            d += Py_SIZE(SLOT_AT(cur, PN_key));
            if (ck_push_unlocked(heap, cur, 0) < 0) {  /* (``_push_if_leaf``: attached) */
                failed = 1;
                break;
            }
        }
    }
    *delta = d;
    pyfield_add(cache, 0, s_evictable, d);
    if (pyfield_add(cache, 0, s_protected, -d) < 0 || failed)
        return -1;
    return 1;
}

/* The root (a Node) and the heap (a list) of a cache, new references: 1, 0 to decline, -1. */
static int
hl_root_heap(PyObject *cache, PyObject **root, PyObject **heap)
{
    *heap = NULL;
    if ((*root = PyObject_GetAttr(cache, s_root_node)) == NULL)
        return -1;
    if (PN_IS(*root) && (*heap = PyObject_GetAttr(cache, s_heap)) != NULL
            && PyList_CheckExact(*heap))
        return 1;
    Py_CLEAR(*root);
    Py_CLEAR(*heap);
    return PyErr_Occurred() ? -1 : 0;
}

/* host_unlock(cache, anchor) -> HostTier._full_write_unlock(anchor)'s delta, or None. */
static PyObject *
core_host_unlock(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(2, "host_unlock(cache, anchor)");
    if (!HL_READY())
        Py_RETURN_NONE;
    PyObject *root, *heap;
    long long delta = 0;
    int r = hl_root_heap(args[0], &root, &heap);
    if (r > 0)
        r = hl_unlock(args[0], root, heap, args[1], &delta);
    Py_XDECREF(root);
    Py_XDECREF(heap);
    if (r < 0)
        return NULL;
    return r == 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(delta);
}

/* The cache's tier where it is exactly HostTier serving this cache (tier.cache is cache): 1
 * (*tier a new reference), 0 to decline, -1. */
static int
hl_own_tier(PyObject *cache, PyObject **tier)
{
    if ((*tier = PyObject_GetAttr(cache, s_hl_tier)) == NULL)
        return -1;
    PyObject *c = NULL;
    if ((PyObject *)Py_TYPE(*tier) == g_hl_tier
            && (c = PyObject_GetAttr(*tier, s_hl_cache)) != NULL && c == cache) {
        Py_DECREF(c);
        return 1;
    }
    Py_XDECREF(c);
    Py_CLEAR(*tier);
    return PyErr_Occurred() ? -1 : 0;
}

/* host_dec(cache, node, params) -> dec_lock_host's DecLockRefResult, or None. */
static PyObject *
core_host_dec(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(3, "host_dec(cache, node, params)");
    PyObject *cache = args[0], *params = args[2];
    if (!HL_READY() || (PyObject *)Py_TYPE(params) != g_hl_dec_params)
        Py_RETURN_NONE;
    PyObject *anchor = PyObject_GetAttr(params, s_hl_anchor), *dis = NULL, *tier = NULL;
    PyObject *root = NULL, *heap = NULL, *out = NULL;
    long long delta = 0;
    int r = 0;
    if (anchor == NULL || anchor == Py_None || (dis = PyObject_GetAttr(cache, s_disable)) == NULL
            || dis != Py_False)  /* (a disabled cache: the Python function's empty result) */
        goto done;
    if ((r = hl_own_tier(cache, &tier)) > 0 && (r = hl_root_heap(cache, &root, &heap)) > 0
            && (r = hl_unlock(cache, root, heap, anchor, &delta)) > 0) {
        PyObject *d = PyLong_FromLongLong(delta);
        out = d == NULL ? NULL : PyObject_Vectorcall(g_hl_dec_result, &d, 1, NULL);
        Py_XDECREF(d);
        if (out == NULL)
            r = -1;
    }
done:
    Py_XDECREF(anchor);
    Py_XDECREF(dis);
    Py_XDECREF(tier);
    Py_XDECREF(root);
    Py_XDECREF(heap);
    if (r < 0)
        return NULL;
    if (out == NULL) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return out;
}

/* Whether o is exactly `cls` as a tuple of `size` items (an Ack, an InFlight). */
#define HL_TUPLE(o, cls, size) ((PyObject *)Py_TYPE(o) == (cls) && PyTuple_GET_SIZE(o) == (size))

/* host_writing(tier) -> True where HostTier.writing_check() ran whole here, else None. */
static PyObject *
core_host_writing(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(1, "host_writing(tier)");
    PyObject *tier = args[0];
    if (!HL_READY() || g_hl_ack == NULL || (PyObject *)Py_TYPE(tier) != g_hl_tier)
        Py_RETURN_NONE;
    PyObject *cc = NULL, *queue = NULL, *tp = NULL, *cache = NULL, *x = NULL, *ongoing = NULL;
    PyObject *root = NULL, *heap = NULL, *ack = NULL, *ids = NULL;
    int r = 0;  /* 1: ran, 0: declined, -1: error */
    if ((cc = PyObject_GetAttr(tier, s_hl_controller)) == NULL
            || (queue = PyObject_GetAttr(cc, s_hl_queue)) == NULL)
        goto fail;
    if (!PyList_CheckExact(queue))
        goto out;
    if (PyList_GET_SIZE(queue) == 0) {  /* nothing queued */
        r = 1;
        goto out;
    }
    if ((tp = PyObject_GetAttr(tier, s_hl_tp_group)) == NULL)
        goto fail;
    if (tp != Py_None)
        goto out;
    /* the done prefix (``_finished``): _Event acks read directly */
    Py_ssize_t done = 0, nq = PyList_GET_SIZE(queue);
    for (; done < nq; done++) {
        PyObject *a = PyList_GET_ITEM(queue, done);
        if (!HL_TUPLE(a, g_hl_ack, 3)
                || (PyObject *)Py_TYPE(PyTuple_GET_ITEM(a, 1)) != g_hl_event)
            goto out;
        PyObject *fl = PyObject_GetAttr(PyTuple_GET_ITEM(a, 1), s_hl_done);
        if (fl == NULL)
            goto fail;
        Py_DECREF(fl);  /* (a bool is immortal enough: compared by identity below) */
        if (fl != Py_True && fl != Py_False)
            goto out;
        if (fl == Py_False)
            break;
    }
    if (done == 0) {
        r = 1;
        goto out;
    }
    /* what the ack loop reads, before its first change: the cache's shape, the in-flight
     * map, each entry popped, each lock's anchor and the path above it */
    if ((cache = PyObject_GetAttr(tier, s_hl_cache)) == NULL)
        goto fail;
    if ((x = PyObject_GetAttr(cache, s_events)) == NULL)
        goto fail;
    if (x != Py_None)
        goto out;
    Py_SETREF(x, PyObject_GetAttr(tier, s_hl_storage));
    if (x == NULL)
        goto fail;
    if (x != Py_None)
        goto out;
    Py_SETREF(x, PyObject_GetAttr(cache, s_hl_components));
    if (x == NULL)
        goto fail;
    if (!(PyTuple_CheckExact(x) || PyList_CheckExact(x)) || PySequence_Fast_GET_SIZE(x) != 0)
        goto out;
    Py_SETREF(x, PyObject_GetAttr(cache, s_disable));
    if (x == NULL)
        goto fail;
    if (x != Py_False)
        goto out;
    if ((ongoing = PyObject_GetAttr(tier, s_hl_ongoing)) == NULL)
        goto fail;
    if (!PyDict_CheckExact(ongoing))
        goto out;
    if ((r = hl_root_heap(cache, &root, &heap)) <= 0)
        goto out;
    r = 0;
    for (Py_ssize_t i = 0; i < done; i++) {
        PyObject *l = PyTuple_GET_ITEM(PyList_GET_ITEM(queue, i), 2);
        if (!PyList_CheckExact(l))
            goto out;
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(l); j++) {
            PyObject *id = PyList_GET_ITEM(l, j);
            if (!PyLong_CheckExact(id))
                goto out;
            PyObject *e = PyDict_GetItemWithError(ongoing, id);  /* borrowed */
            if (e == NULL) {
                if (PyErr_Occurred())
                    goto fail;
                continue;
            }
            if (!HL_TUPLE(e, g_hl_in_flight, 2))
                goto out;
            PyObject *lock = PyTuple_GET_ITEM(e, 1);
            if (lock == Py_None)
                continue;
            if ((PyObject *)Py_TYPE(lock) != g_hl_dec_params)
                goto out;
            PyObject *anchor = PyObject_GetAttr(lock, s_hl_anchor);
            if (anchor == NULL)
                goto fail;
            Py_DECREF(anchor);  /* (the params hold it) */
            for (PyObject *cur = anchor; cur != root; cur = SLOT_AT(cur, PN_parent))
                if (!ck_node_ok(cur, -1, 0))
                    goto out;
        }
    }
    /* the loop: each ack off the queue, its ids' entries popped and their locks released */
    for (Py_ssize_t i = 0; i < done; i++) {
        ack = Py_NewRef(PyList_GET_ITEM(queue, 0));
        if (PyList_SetSlice(queue, 0, 1, NULL) < 0)  /* del queue[0] */
            goto fail;
        ids = Py_NewRef(PyTuple_GET_ITEM(ack, 2));
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(ids); j++) {
            PyObject *id = PyList_GET_ITEM(ids, j);
            PyObject *e = PyDict_GetItemWithError(ongoing, id);
            if (e == NULL) {
                if (PyErr_Occurred())
                    goto fail;
                continue;
            }
            Py_INCREF(e);
            if (PyDict_DelItem(ongoing, id) < 0) {
                Py_DECREF(e);
                goto fail;
            }
            PyObject *lock = PyTuple_GET_ITEM(e, 1);
            if (lock != Py_None) {
                PyObject *anchor = PyObject_GetAttr(lock, s_hl_anchor);
                long long delta;
                int u = anchor == NULL ? -1 : hl_unlock(cache, root, heap, anchor, &delta);
                Py_XDECREF(anchor);
                if (u == 0)  /* (checked above: the tree changed under the loop) */
                    PyErr_SetString(PyExc_RuntimeError, "host_writing: a lock's path changed");
                if (u <= 0) {
                    Py_DECREF(e);
                    goto fail;
                }
            }
            Py_DECREF(e);
        }
        Py_CLEAR(ids);
        Py_CLEAR(ack);
    }
    r = 1;
    goto out;
fail:
    r = -1;
out:
    Py_XDECREF(cc);
    Py_XDECREF(queue);
    Py_XDECREF(tp);
    Py_XDECREF(cache);
    Py_XDECREF(x);
    Py_XDECREF(ongoing);
    Py_XDECREF(root);
    Py_XDECREF(heap);
    Py_XDECREF(ack);
    Py_XDECREF(ids);
    if (r < 0)
        return NULL;
    if (r == 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_RETURN_TRUE;
}

#undef HL_TUPLE
#undef HL_READY

/* ---- host tier: Full insert (host_insert) ---- */
/*
 * host_insert: fast/host_full.py insert_host from the root's stamp on (its checks, the key's
 * parts, the plan and the slot ledger's checks stay in Python and run first), for the Full
 * component alone over the host tier: each planned node stamped and pushed where it is an
 * unlocked device leaf (an evicted one re-entered on the host heap through the tier's
 * ``restamped``), split where the insert ends inside it (the cache's ``_split``), restored
 * from the fresh slots where it was evicted (the cache's ``_unevict``), the caller's
 * duplicates queued on the insert's ``_deferred`` one piece per node, hits counted, the new
 * leaf (fast/node.py's Node, called as the Python path calls it: the same ids), its slots
 * owned where the ledger is kept, pushed, counted.  A backup a hit asks for is
 * HostTier._write_backup_full written out where the tier's ``write_backup`` is that method
 * and its written-out case holds (the controller only queues acks, no KV events, no aux
 * component, not disabled; the stock ``_full_write_lock``): the parent first, the host
 * pool's ``alloc`` (on a short pool ``available_size``, ``evict_host`` and ``alloc`` again,
 * the Python calls), the ack queued, the host copy kept (a view of the pool's own storage
 * cloned), ``host_tokens``, and the write lock (``lock_walk`` inline; its params the
 * HostDecLockRefParams class called) filed in ``ongoing_write_through``.  Anything else
 * calls ``tier.write_backup`` itself.  The same steps, in the same order, as the Python
 * loop; the cache's _clock is written at every step, as there, and read again after every
 * Python call that may move it.  It declines (None, nothing changed) where the Python loop
 * takes what this does not: a plan entry that is not (Node, int), units that are not an int64
 * buffer of n units, a _heap or _deferred that is not a plain list, a tier that is not exactly HostTier, a clock, count or threshold that
 * is not a plain int.  tests/fast/test_host_insert_twin.py runs it against the Python loop.
 */

static PyTypeObject *g_hi_tier = NULL, *g_hi_ack = NULL, *g_hi_inflight = NULL;
/* The three objects a backup or a new leaf makes, made here as their __init__ makes them
 * (hi_make): Node (its id drawn from fast/node.py's _ids as its __init__ draws it), _Event,
 * HostDecLockRefParams; each __init__ as setup found it (where a class's __init__ or
 * __new__ is another one now, the class is called). */
static PyObject *g_hi_node_init = NULL, *g_hi_node_globals = NULL, *g_hi_event_init = NULL,
    *g_hi_lockp_init = NULL, *s_hi_init, *s_hi_ids;
static Py_ssize_t HI_event_done = 0, HI_lp_uuid = 0, HI_lp_host_uuid = 0, HI_lp_skip = 0,
    HI_lp_anchor = 0;
/* InsertParams' answer, InsertResult (fast/params.py, a dataclass with slots), likewise */
static PyObject *g_hi_result_init = NULL;
static Py_ssize_t HI_ir_prefix = 0, HI_ir_total = 0, HI_ir_exist = 0, HI_ir_host = 0;
static PyObject *g_hi_wbf = NULL, *g_hi_fwl = NULL, *g_hi_event = NULL, *g_hi_lockp = NULL,
    *g_hi_kw_anchor = NULL, *g_hi_one = NULL;
static PyObject *s_hi_tier, *s_hi_write_back, *s_hi_threshold, *s_hi_write_backup,
    *s_hi_controller, *s_hi_ack_only, *s_hi_components, *s_hi_cache, *s_hi_fwl, *s_hi_pool,
    *s_hi_alloc, *s_hi_available, *s_hi_evict_host, *s_hi_ackq, *s_hi_sync, *s_hi_host_tokens,
    *s_hi_ongoing, *s_hi_base, *s_hi_clone, *s_hi_restamped, *s_hi_unevict, *s_hi_hit_count,
    *s_hi_host_value, *s_hi_id, *s_hi_clock, *s_hi_events, *s_hi_disable, *s_hi_heap,
    *s_hi_evictable, *s_hi_protected, *s_hi_root, *s_hi_split, *s_hi_parent, *s_hi_value,
    *s_hi_key, *s_hi_lock_ref, *s_hi_dev_children, *s_hi_children, *s_hi_stamp, *s_hi_shape,
    *s_hi_update, *s_hi_tolist;

static int hi_slot(PyTypeObject *tp, const char *name, Py_ssize_t *off);

/* host_insert_setup(HostTier, _write_backup_full, _full_write_lock, _Event, Ack, InFlight,
 * HostDecLockRefParams): the classes and functions the written-out backup stands for. */
static PyObject *
core_host_insert_setup(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7 || !PyType_Check(args[0]) || !PyType_Check(args[4])
            || !PyType_Check(args[5]) || !PyType_IsSubtype((PyTypeObject *)args[4], &PyTuple_Type)
            || !PyType_IsSubtype((PyTypeObject *)args[5], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "host_insert_setup(HostTier, _write_backup_full, "
                        "_full_write_lock, _Event, Ack, InFlight, HostDecLockRefParams)");
        return NULL;
    }
    if (s_hi_tier == NULL) {
#define HI_INTERN(var, s) if ((var = PyUnicode_InternFromString(s)) == NULL) return NULL
        HI_INTERN(s_hi_tier, "tier");
        HI_INTERN(s_hi_write_back, "write_back");
        HI_INTERN(s_hi_threshold, "write_through_threshold");
        HI_INTERN(s_hi_write_backup, "write_backup");
        HI_INTERN(s_hi_controller, "controller");
        HI_INTERN(s_hi_ack_only, "ack_only");
        HI_INTERN(s_hi_components, "components");
        HI_INTERN(s_hi_cache, "cache");
        HI_INTERN(s_hi_fwl, "_full_write_lock");
        HI_INTERN(s_hi_pool, "mem_pool_host");
        HI_INTERN(s_hi_alloc, "alloc");
        HI_INTERN(s_hi_available, "available_size");
        HI_INTERN(s_hi_evict_host, "evict_host");
        HI_INTERN(s_hi_ackq, "ack_write_queue");
        HI_INTERN(s_hi_sync, "sync");
        HI_INTERN(s_hi_host_tokens, "host_tokens");
        HI_INTERN(s_hi_ongoing, "ongoing_write_through");
        HI_INTERN(s_hi_base, "_base");
        HI_INTERN(s_hi_clone, "clone");
        HI_INTERN(s_hi_restamped, "restamped");
        HI_INTERN(s_hi_unevict, "_unevict");
        HI_INTERN(s_hi_hit_count, "hit_count");
        HI_INTERN(s_hi_host_value, "host_value");
        HI_INTERN(s_hi_id, "id");
        HI_INTERN(s_hi_clock, "_clock");
        HI_INTERN(s_hi_events, "_events");
        HI_INTERN(s_hi_disable, "disable");
        HI_INTERN(s_hi_heap, "_heap");
        HI_INTERN(s_hi_evictable, "_evictable");
        HI_INTERN(s_hi_protected, "_protected");
        HI_INTERN(s_hi_root, "root_node");
        HI_INTERN(s_hi_split, "_split");
        HI_INTERN(s_hi_parent, "parent");
        HI_INTERN(s_hi_value, "value");
        HI_INTERN(s_hi_key, "key");
        HI_INTERN(s_hi_lock_ref, "lock_ref");
        HI_INTERN(s_hi_dev_children, "dev_children");
        HI_INTERN(s_hi_children, "children");
        HI_INTERN(s_hi_stamp, "last_access_time");
        HI_INTERN(s_hi_shape, "shape");
        HI_INTERN(s_hi_update, "update");
        HI_INTERN(s_hi_tolist, "tolist");
        HI_INTERN(s_hi_init, "__init__");
        HI_INTERN(s_hi_ids, "_ids");
#undef HI_INTERN
    }
    PyObject *kw = PyTuple_Pack(1, PyUnicode_InternFromString("anchor"));
    if (kw == NULL)
        return NULL;
    Py_XSETREF(g_hi_kw_anchor, kw);
    if (g_hi_one == NULL && (g_hi_one = PyLong_FromLong(1)) == NULL)
        return NULL;
    Py_XSETREF(g_hi_tier, (PyTypeObject *)Py_NewRef(args[0]));
    Py_XSETREF(g_hi_wbf, Py_NewRef(args[1]));
    Py_XSETREF(g_hi_fwl, Py_NewRef(args[2]));
    Py_XSETREF(g_hi_event, Py_NewRef(args[3]));
    Py_XSETREF(g_hi_ack, (PyTypeObject *)Py_NewRef(args[4]));
    Py_XSETREF(g_hi_inflight, (PyTypeObject *)Py_NewRef(args[5]));
    Py_XSETREF(g_hi_lockp, Py_NewRef(args[6]));
    /* the constructors' __init__ and slots, where they are the plain ones (else the class is
     * called: hi_make) */
    Py_CLEAR(g_hi_node_init);
    Py_CLEAR(g_hi_node_globals);
    Py_CLEAR(g_hi_event_init);
    Py_CLEAR(g_hi_lockp_init);
    PyObject *ni = g_pn_type == NULL ? NULL : _PyType_Lookup(g_pn_type, s_hi_init);
    if (ni != NULL && PyFunction_Check(ni)) {
        g_hi_node_init = Py_NewRef(ni);
        g_hi_node_globals = Py_NewRef(PyFunction_GET_GLOBALS(ni));
    }
    if (PyType_Check(args[3]) && hi_slot((PyTypeObject *)args[3], "done", &HI_event_done) == 0) {
        PyObject *ei = _PyType_Lookup((PyTypeObject *)args[3], s_hi_init);
        g_hi_event_init = ei == NULL ? NULL : Py_NewRef(ei);
    }
    if (PyType_Check(args[6])) {
        PyTypeObject *lt = (PyTypeObject *)args[6];
        if (hi_slot(lt, "swa_uuid_for_lock", &HI_lp_uuid) == 0
                && hi_slot(lt, "swa_uuid_for_host_lock", &HI_lp_host_uuid) == 0
                && hi_slot(lt, "skip_lock_node_ids", &HI_lp_skip) == 0
                && hi_slot(lt, "anchor", &HI_lp_anchor) == 0) {
            PyObject *li = _PyType_Lookup(lt, s_hi_init);
            g_hi_lockp_init = li == NULL ? NULL : Py_NewRef(li);
        }
    }
    Py_CLEAR(g_hi_result_init);
    if (g_InsertResult != NULL && PyType_Check(g_InsertResult)) {
        PyTypeObject *rt = (PyTypeObject *)g_InsertResult;
        if (hi_slot(rt, "prefix_len", &HI_ir_prefix) == 0
                && hi_slot(rt, "total_len", &HI_ir_total) == 0
                && hi_slot(rt, "mamba_exist", &HI_ir_exist) == 0
                && hi_slot(rt, "inserted_host_node", &HI_ir_host) == 0) {
            PyObject *ri = _PyType_Lookup(rt, s_hi_init);
            g_hi_result_init = ri == NULL ? NULL : Py_NewRef(ri);
        }
    }
    PyErr_Clear();  /* (a class without those slots: it is called) */
    Py_RETURN_NONE;
}

/* The offset of the writable object slot `name` of tp or a base (0, or -1 with an error). */
static int
hi_slot(PyTypeObject *tp, const char *name, Py_ssize_t *off)
{
    PyObject *nm = PyUnicode_InternFromString(name);
    if (nm == NULL)
        return -1;
    PyObject *d = _PyType_Lookup(tp, nm);  /* borrowed */
    Py_DECREF(nm);
    if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a __slots__ field", tp->tp_name, name);
        return -1;
    }
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    if (m->type != T_OBJECT_EX || (m->flags & READONLY) || m->offset <= 0) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a writable object slot", tp->tp_name, name);
        return -1;
    }
    *off = m->offset;
    return 0;
}

/* A fresh instance of tp as object.__new__ makes it, where tp's __init__ is still `init` and
 * its __new__ object's: 1 (*out set, or NULL with the error set), 0 (call the class). */
static int
hi_alloc(PyTypeObject *tp, PyObject *init, PyObject **out)
{
    if (init == NULL || tp->tp_new != PyBaseObject_Type.tp_new
            || (tp->tp_flags & Py_TPFLAGS_IS_ABSTRACT) || _PyType_Lookup(tp, s_hi_init) != init)
        return 0;
    *out = tp->tp_alloc(tp, 0);
    return 1;
}

/* Store v (a new reference, stolen) in a fresh object's slot. */
#define HI_FILL(o, off, v) (SLOT_AT((o), (off)) = (v))

/* Node(key, value, parent, extra_key, stamp, ck) (fast/node.py): its __init__'s fields, its id
 * next(_ids) of its module's counter; the class called where hi_alloc says so. */
static PyObject *
hi_new_node(PyObject **a)
{
    PyObject *n = NULL, *ids = g_hi_node_globals == NULL ? NULL
        : PyDict_GetItemWithError(g_hi_node_globals, s_hi_ids);  /* borrowed */
    if (ids == NULL && PyErr_Occurred())
        return NULL;
    if (ids == NULL || !PyIter_Check(ids) || !hi_alloc(g_pn_type, g_hi_node_init, &n))
        return PyObject_Vectorcall((PyObject *)g_pn_type, a, 6, NULL);
    if (n == NULL)
        return NULL;
    PyObject *children = PyDict_New(), *aux = children == NULL ? NULL : PyTuple_New(0);
    if (aux == NULL) {
        Py_XDECREF(children);
        Py_DECREF(n);
        return NULL;
    }
    /* (the order of its __init__; the id drawn where it draws it) */
    HI_FILL(n, PN_ck, Py_NewRef(a[5]));
    HI_FILL(n, PN_children, children);
    HI_FILL(n, PN_parent, Py_NewRef(a[2]));
    HI_FILL(n, PN_key, Py_NewRef(a[0]));
    HI_FILL(n, PN_value, Py_NewRef(a[1]));
    HI_FILL(n, PN_lock_ref, Py_NewRef(s_zero));
    HI_FILL(n, PN_last_access_time, Py_NewRef(a[4]));
    HI_FILL(n, PN_hit_count, Py_NewRef(s_zero));
    HI_FILL(n, PN_extra_key, Py_NewRef(a[3]));
    HI_FILL(n, PN_dev_children, Py_NewRef(s_zero));
    PyObject *id = PyIter_Next(ids);
    if (id == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetNone(PyExc_StopIteration);
        Py_DECREF(aux);
        Py_DECREF(n);
        return NULL;
    }
    HI_FILL(n, PN_id, id);
    HI_FILL(n, PN_host_value, Py_NewRef(Py_None));
    HI_FILL(n, PN_host_lock_ref, Py_NewRef(s_zero));
    HI_FILL(n, PN_aux, aux);
    HI_FILL(n, PN_aux_lock, Py_NewRef(s_zero));
    HI_FILL(n, PN_created, Py_NewRef(a[4]));
    HI_FILL(n, PN_priority, Py_NewRef(s_zero));
    return n;
}

/* InsertResult(pos, total, False): its dataclass __init__'s fields (inserted_host_node None). */
static PyObject *
hi_result(Py_ssize_t pos, Py_ssize_t total)
{
    PyObject *r = NULL;
    if (HI_ir_host <= 0 || !PyType_Check(g_InsertResult)
            || !hi_alloc((PyTypeObject *)g_InsertResult, g_hi_result_init, &r))
        return ci_result(pos, total, 0);
    if (r == NULL)
        return NULL;
    PyObject *a = PyLong_FromSsize_t(pos), *b = a == NULL ? NULL : PyLong_FromSsize_t(total);
    if (b == NULL) {
        Py_XDECREF(a);
        Py_DECREF(r);
        return NULL;
    }
    HI_FILL(r, HI_ir_prefix, a);
    HI_FILL(r, HI_ir_total, b);
    HI_FILL(r, HI_ir_exist, Py_NewRef(Py_False));
    HI_FILL(r, HI_ir_host, Py_NewRef(Py_None));
    return r;
}

/* _Event(done) (fast/tiers/host.py). */
static PyObject *
hi_new_event(PyObject *done)
{
    PyObject *e = NULL;
    if (HI_event_done <= 0 || !hi_alloc((PyTypeObject *)g_hi_event, g_hi_event_init, &e))
        return PyObject_CallOneArg(g_hi_event, done);
    if (e != NULL)
        HI_FILL(e, HI_event_done, Py_NewRef(done));
    return e;
}

/* HostDecLockRefParams(anchor=node): its dataclass __init__'s fields (the two uuids None, a
 * fresh dict of skipped ids, the anchor). */
static PyObject *
hi_new_lock_params(PyObject *node)
{
    PyObject *p = NULL;
    if (HI_lp_anchor <= 0 || !PyType_Check(g_hi_lockp)
            || !hi_alloc((PyTypeObject *)g_hi_lockp, g_hi_lockp_init, &p)) {
        PyObject *a[1] = {node};
        return PyObject_Vectorcall(g_hi_lockp, a, 0, g_hi_kw_anchor);
    }
    if (p == NULL)
        return NULL;
    PyObject *skip = PyDict_New();
    if (skip == NULL) {
        Py_DECREF(p);
        return NULL;
    }
    HI_FILL(p, HI_lp_uuid, Py_NewRef(Py_None));
    HI_FILL(p, HI_lp_host_uuid, Py_NewRef(Py_None));
    HI_FILL(p, HI_lp_skip, skip);
    HI_FILL(p, HI_lp_anchor, Py_NewRef(node));
    return p;
}

/* tuple.__new__(cls, (a, b, c...)) for a tuple subclass (the backup's Ack and InFlight
 * records, as host.py's _ack / _in_flight make them); items borrowed. */
static PyObject *
hi_record(PyTypeObject *cls, Py_ssize_t k, PyObject **items)
{
    PyObject *t = cls->tp_alloc(cls, k);
    if (t == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < k; i++)
        PyTuple_SET_ITEM(t, i, Py_NewRef(items[i]));
    return t;
}

/* One insert's state: the objects the steps read (new references, released at the end). */
typedef struct {
    PyObject *cache, *tier, *root, *heap;
    int inline_backup;  /* the tier's write_backup is _write_backup_full's written-out case */
} HiCtx;

/* `o.name` of a Node field through its slot where o is a Node: new reference. */
#define HI_GET(o, f, name) pyfield_get((o), PN_OFF((o), PN_##f), (name))
#define HI_SET(o, f, name, v) pyfield_set((o), PN_OFF((o), PN_##f), (name), (v))

/* `o.name is None` for a Node field: 1, 0, -1. */
static int
hi_is_none(PyObject *o, Py_ssize_t off, PyObject *name)
{
    PyObject *v = pyfield_get(o, off, name);
    if (v == NULL)
        return -1;
    int r = v == Py_None;
    Py_DECREF(v);
    return r;
}

/* `a OP b` for Python objects: 1, 0, -1. */
static int
hi_cmp(PyObject *a, PyObject *b, int op)
{
    return PyObject_RichCompareBool(a, b, op);
}

/* ``HostTier._full_write_lock(node)``: lock_walk(node, root) (each node up to the root one
 * lock more; the units of those that were unlocked), the cache's counters moved, and
 * HostDecLockRefParams(anchor=node).  New reference. */
static PyObject *
hi_write_lock(HiCtx *x, PyObject *node)
{
    long long delta = 0;
    PyObject *cur = Py_NewRef(node);
    while (cur != x->root) {
        int z = pyfield_eq_zero(cur, PN_OFF(cur, PN_lock_ref), s_hi_lock_ref);
        if (z < 0)
            goto fail;
        if (z) {
            Py_ssize_t k = pn_key_len(cur);
            if (k < 0)
                goto fail;
            delta += k;
        }
        if (pyfield_add(cur, PN_OFF(cur, PN_lock_ref), s_hi_lock_ref, 1) < 0)
            goto fail;
        Py_SETREF(cur, HI_GET(cur, parent, s_hi_parent));
        if (cur == NULL)
            return NULL;
    }
    Py_DECREF(cur);
    {
        PyObject *d = PyLong_FromLongLong(delta), *v, *w;
        if (d == NULL)
            return NULL;
        int ok = -1;
        /* cache._evictable -= delta; cache._protected += delta (Python's in-place ops) */
        if ((v = PyObject_GetAttr(x->cache, s_hi_evictable)) != NULL) {
            w = PyNumber_InPlaceSubtract(v, d);
            Py_DECREF(v);
            if (w != NULL) {
                ok = PyObject_SetAttr(x->cache, s_hi_evictable, w);
                Py_DECREF(w);
            }
        }
        if (ok == 0) {
            ok = -1;
            if ((v = PyObject_GetAttr(x->cache, s_hi_protected)) != NULL) {
                w = PyNumber_InPlaceAdd(v, d);
                Py_DECREF(v);
                if (w != NULL) {
                    ok = PyObject_SetAttr(x->cache, s_hi_protected, w);
                    Py_DECREF(w);
                }
            }
        }
        Py_DECREF(d);
        if (ok < 0)
            return NULL;
    }
    return hi_new_lock_params(node);
fail:
    Py_DECREF(cur);
    return NULL;
}

static PyObject *core_host_take(PyObject *, PyObject *const *, Py_ssize_t);

/* a[0].alloc(a[1]) for a backup (a[0] its host pool, a[1] the size): host_take where it writes
 * that alloc out (a tensor of its own, never a view), else the pool's own call. */
static PyObject *
hi_pool_alloc(PyObject **a)
{
    PyObject *host = core_host_take(NULL, a, 2);
    if (host != Py_NotImplemented)
        return host;
    Py_DECREF(host);
    return PyObject_VectorcallMethod(s_hi_alloc, a, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* ``tier.write_backup(node)``: HostTier._write_backup_full written out (x->inline_backup:
 * the slots written, 0 for none), else the tier's own method called (its answer dropped, as
 * insert_host drops it: 0); -1 with the error set. */
static long long
hi_backup(HiCtx *x, PyObject *node)
{
    if (!x->inline_backup) {
        PyObject *a[2] = {x->tier, node};
        return discard(PyObject_VectorcallMethod(s_hi_write_backup, a,
                                                 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL));
    }
    long long result = -1;
    PyObject *parent = NULL, *value = NULL, *shape = NULL, *n_o = NULL, *cc = NULL, *pool = NULL,
             *host = NULL, *avail = NULL, *needed = NULL, *got = NULL, *q = NULL, *sync = NULL,
             *ev = NULL, *id = NULL, *ids = NULL, *ack = NULL, *base = NULL, *hv = NULL,
             *lock = NULL, *rec = NULL, *ongoing = NULL;
    if ((parent = HI_GET(node, parent, s_hi_parent)) == NULL)
        goto done;
    if (parent == Py_None) {
        PyErr_SetString(PyExc_AssertionError, "write_backup of the root or a detached node");
        goto done;
    }
    if (parent != x->root) {  /* write-through: the parent first */
        int none = hi_is_none(parent, PN_OFF(parent, PN_host_value), s_hi_host_value);
        if (none < 0)
            goto done;
        if (none) {
            long long r = hi_backup(x, parent);
            if (r < 0)
                goto done;
            if (r <= 0) {
                result = 0;
                goto done;
            }
        }
    }
    if ((value = HI_GET(node, value, s_hi_value)) == NULL
            || (shape = PyObject_GetAttr(value, s_hi_shape)) == NULL
            || (n_o = PySequence_GetItem(shape, 0)) == NULL
            || (cc = PyObject_GetAttr(x->tier, s_hi_controller)) == NULL
            || (pool = PyObject_GetAttr(cc, s_hi_pool)) == NULL)
        goto done;
    {
        PyObject *a[2] = {pool, n_o};
        host = hi_pool_alloc(a);
    }
    if (host == NULL)
        goto done;
    if (host == Py_None) {  /* (``_take_host``: room made only when the pool is short) */
        if ((avail = PyObject_CallMethodNoArgs(pool, s_hi_available)) == NULL)
            goto done;
        int c = hi_cmp(avail, n_o, Py_GE);
        if (c < 0)
            goto done;
        if (c) {
            result = 0;
            goto done;
        }
        if ((needed = PyNumber_Subtract(n_o, avail)) == NULL
                || (got = PyObject_CallMethodOneArg(x->tier, s_hi_evict_host, needed)) == NULL
                || (c = hi_cmp(got, needed, Py_LT)) < 0)
            goto done;
        if (c) {
            result = 0;
            goto done;
        }
        Py_SETREF(host, NULL);
        PyObject *a[2] = {pool, n_o};
        host = hi_pool_alloc(a);
        if (host == NULL)
            goto done;
        if (host == Py_None) {
            result = 0;
            goto done;
        }
    }
    /* cc.ack_write_queue.append(_ack((None, _Event(cc.sync), [node.id]))) */
    if ((q = PyObject_GetAttr(cc, s_hi_ackq)) == NULL
            || (sync = PyObject_GetAttr(cc, s_hi_sync)) == NULL
            || (ev = hi_new_event(sync)) == NULL
            || (id = HI_GET(node, id, s_hi_id)) == NULL
            || (ids = PyList_New(1)) == NULL)
        goto done;
    PyList_SET_ITEM(ids, 0, Py_NewRef(id));
    {
        PyObject *items[3] = {Py_None, ev, ids};
        if ((ack = hi_record(g_hi_ack, 3, items)) == NULL)
            goto done;
    }
    if (PyList_CheckExact(q) ? PyList_Append(q, ack) < 0
            : discard(PyObject_CallMethod(q, "append", "O", ack)) < 0)
        goto done;
    /* node.host_value = host if host._base is None else host.clone() */
    if ((base = PyObject_GetAttr(host, s_hi_base)) == NULL)
        goto done;
    hv = base == Py_None ? Py_NewRef(host) : PyObject_CallMethodNoArgs(host, s_hi_clone);
    if (hv == NULL || HI_SET(node, host_value, s_hi_host_value, hv) < 0)
        goto done;
    {  /* self.host_tokens += n */
        PyObject *t = PyObject_GetAttr(x->tier, s_hi_host_tokens), *s = NULL;
        if (t == NULL)
            goto done;
        s = PyNumber_InPlaceAdd(t, n_o);
        Py_DECREF(t);
        if (s == NULL)
            goto done;
        int r = PyObject_SetAttr(x->tier, s_hi_host_tokens, s);
        Py_DECREF(s);
        if (r < 0)
            goto done;
    }
    /* self.ongoing_write_through[node.id] = _in_flight((node, self._full_write_lock(node))) */
    if ((lock = hi_write_lock(x, node)) == NULL)
        goto done;
    {
        PyObject *items[2] = {node, lock};
        if ((rec = hi_record(g_hi_inflight, 2, items)) == NULL)
            goto done;
    }
    Py_SETREF(id, HI_GET(node, id, s_hi_id));
    if (id == NULL || (ongoing = PyObject_GetAttr(x->tier, s_hi_ongoing)) == NULL
            || PyObject_SetItem(ongoing, id, rec) < 0)
        goto done;
    result = PyLong_AsLongLong(n_o);
done:
    Py_XDECREF(parent);
    Py_XDECREF(value);
    Py_XDECREF(shape);
    Py_XDECREF(n_o);
    Py_XDECREF(cc);
    Py_XDECREF(pool);
    Py_XDECREF(host);
    Py_XDECREF(avail);
    Py_XDECREF(needed);
    Py_XDECREF(got);
    Py_XDECREF(q);
    Py_XDECREF(sync);
    Py_XDECREF(ev);
    Py_XDECREF(id);
    Py_XDECREF(ids);
    Py_XDECREF(ack);
    Py_XDECREF(base);
    Py_XDECREF(hv);
    Py_XDECREF(lock);
    Py_XDECREF(rec);
    Py_XDECREF(ongoing);
    return result;
}

/* Whether the tier's write_backup is _write_backup_full's written-out case (see above): 1, 0,
 * -1.  Reads only. */
static int
hi_inline_backup(PyObject *cache, PyObject *tier)
{
    int ok = 0;
    PyObject *wb = NULL, *fwl = NULL, *owner = NULL, *cc = NULL, *only = NULL, *ev = NULL,
             *dis = NULL, *comps = NULL;
    if ((wb = PyObject_GetAttr(tier, s_hi_write_backup)) == NULL
            || (fwl = PyObject_GetAttr(tier, s_hi_fwl)) == NULL
            || (owner = PyObject_GetAttr(tier, s_hi_cache)) == NULL
            || (cc = PyObject_GetAttr(tier, s_hi_controller)) == NULL
            || (only = PyObject_GetAttr(cc, s_hi_ack_only)) == NULL
            || (ev = PyObject_GetAttr(cache, s_hi_events)) == NULL
            || (dis = PyObject_GetAttr(cache, s_hi_disable)) == NULL
            || (comps = PyObject_GetAttr(cache, s_hi_components)) == NULL) {
        ok = -1;
        goto done;
    }
    if (PyMethod_Check(wb) && PyMethod_GET_FUNCTION(wb) == g_hi_wbf
            && PyMethod_GET_SELF(wb) == tier && PyMethod_Check(fwl)
            && PyMethod_GET_FUNCTION(fwl) == g_hi_fwl && PyMethod_GET_SELF(fwl) == tier
            && owner == cache && only == Py_True && ev == Py_None && dis == Py_False) {
        int some = PyObject_IsTrue(comps);
        ok = some < 0 ? -1 : !some;
    }
done:
    Py_XDECREF(wb);
    Py_XDECREF(fwl);
    Py_XDECREF(owner);
    Py_XDECREF(cc);
    Py_XDECREF(only);
    Py_XDECREF(ev);
    Py_XDECREF(dis);
    Py_XDECREF(comps);
    return ok;
}

/* cache._clock = clock + stride, the stamp returned (new reference): the Python loop's
 * ``clock = cache._clock + STRIDE; cache._clock = clock``. */
static PyObject *
hi_tick(PyObject *cache)
{
    long long c;
    if (get_ll(cache, s_hi_clock, &c) < 0)
        return NULL;
    PyObject *stamp = PyLong_FromLongLong(c + g_stride);
    if (stamp != NULL && PyObject_SetAttr(cache, s_hi_clock, stamp) < 0)
        Py_CLEAR(stamp);
    return stamp;
}

/* ``count_hit`` as _insert writes it: node.hit_count += 1, then the tier's write_backup where
 * the count reached the threshold (check_host: only where the node has no host copy).  0 or
 * -1. */
static int
hi_hit(HiCtx *x, PyObject *node, PyObject *thr, long long threshold, int check_host)
{
    PyObject *hc = HI_GET(node, hit_count, s_hi_hit_count), *cnt;
    if (hc == NULL)
        return -1;
    cnt = PyNumber_Add(hc, g_hi_one);
    Py_DECREF(hc);
    if (cnt == NULL)
        return -1;
    int r = HI_SET(node, hit_count, s_hi_hit_count, cnt);
    Py_DECREF(cnt);
    if (r < 0)
        return -1;
    if (check_host) {
        int hn = hi_is_none(node, PN_OFF(node, PN_host_value), s_hi_host_value);
        if (hn <= 0)
            return hn;
    }
    if ((cnt = HI_GET(node, hit_count, s_hi_hit_count)) == NULL)
        return -1;
    long long cv = 0;
    int cmp = exact_ll(cnt, &cv) ? cv >= threshold : PyObject_RichCompareBool(cnt, thr, Py_GE);
    Py_DECREF(cnt);
    if (cmp <= 0)
        return cmp;
    return hi_backup(x, node) < 0 ? -1 : 0;
}

/* The walk's plan entry i (child, shared) of host_insert and host_aux_insert (the plan is
 * the caller's list, which a callback could change: a RuntimeError naming `where`); *child
 * takes a new reference.  0 or -1. */
static int
hi_plan_at(PyObject *plan, Py_ssize_t i, const char *where, PyObject **child,
           Py_ssize_t *shared)
{
    if (i >= PyList_GET_SIZE(plan)) {
        PyErr_Format(PyExc_RuntimeError, "%s: the plan changed", where);
        return -1;
    }
    PyObject *it = PyList_GET_ITEM(plan, i);
    Py_XSETREF(*child, Py_NewRef(PyTuple_GET_ITEM(it, 0)));
    *shared = PyLong_AsSsize_t(PyTuple_GET_ITEM(it, 1));
    return *shared == -1 && PyErr_Occurred() ? -1 : 0;
}

/* ``_touch`` of a planned node over the host tier: its stamp (a new tick, kept in *stamp),
 * the heap push of an unlocked device leaf, or the host heap's entry through the tier's
 * ``restamped`` for an evicted one.  0 or -1. */
static int
hi_touch(PyObject *cache, HiCtx *x, PyObject *child, PyObject **stamp)
{
    Py_XSETREF(*stamp, hi_tick(cache));
    if (*stamp == NULL || HI_SET(child, last_access_time, s_hi_stamp, *stamp) < 0)
        return -1;
    int none = hi_is_none(child, PN_OFF(child, PN_value), s_hi_value);
    if (none < 0)
        return -1;
    if (!none) {
        int leaf = pn_unlocked_leaf(child);
        return leaf < 0 || (leaf && pn_heap_push(x->heap, *stamp, child) < 0) ? -1 : 0;
    }
    return discard(PyObject_CallMethodOneArg(x->tier, s_hi_restamped, child));
}

/* A walk step's split: where the insert ends inside *child (shared < its key's length),
 * *child becomes the upper part the cache's ``_split`` answers.  0 or -1. */
static int
hi_split_at(PyObject *cache, PyObject **child, Py_ssize_t shared)
{
    Py_ssize_t klen = pn_key_len(*child);
    if (klen < 0)
        return -1;
    if (shared >= klen)
        return 0;
    PyObject *k = PyLong_FromSsize_t(shared), *up = NULL;
    if (k != NULL) {
        PyObject *a[3] = {cache, *child, k};
        up = PyObject_VectorcallMethod(s_hi_split, a, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(k);
    }
    if (up == NULL)
        return -1;
    Py_SETREF(*child, up);
    return 0;
}

/* The insert's new leaf (host_insert, host_aux_insert): a new tick in *stamp, the rest of the
 * units as its key, its child key (``_ck``: the first page, read from units in place; a
 * RuntimeError naming `where` if units changed), its own copy of value[pos:n], made by
 * hi_new_node; the leaf and, in *ck, its child key (new references), or NULL. */
static PyObject *
hi_leaf_new(PyObject *cache, PyObject *units, PyObject *value, PyObject *node, PyObject *ek,
            Py_ssize_t pos, Py_ssize_t n, Py_ssize_t ps, const char *where, PyObject **stamp,
            PyObject **ck)
{
    PyObject *rest = NULL, *full = NULL, *leaf = NULL;
    *ck = NULL;
    Py_XSETREF(*stamp, hi_tick(cache));
    if (*stamp == NULL || (rest = PySequence_GetSlice(units, pos, PY_SSIZE_T_MAX)) == NULL)
        goto done;
    KeyView kv;
    if (key_view(units, &kv) < 0)
        goto done;
    *ck = kv.n >= pos + ps ? child_key(kv.p, pos, ps, ek) : NULL;
    key_release(&kv);
    if (*ck == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_RuntimeError, "%s: the units changed", where);
        goto done;
    }
    if ((full = narrow_copy(value, pos, n - pos)) == NULL)
        goto done;
    PyObject *na[6] = {rest, full, node, ek, *stamp, *ck};
    leaf = hi_new_node(na);
done:
    Py_XDECREF(rest);
    Py_XDECREF(full);
    if (leaf == NULL)
        Py_CLEAR(*ck);
    return leaf;
}

/* value[lo:hi] queued on the insert's deferred frees where lo < hi (``_free``: one piece per
 * node).  0 or -1. */
static int
hi_defer(PyObject *value, PyObject *deferred, Py_ssize_t lo, Py_ssize_t hi)
{
    if (lo >= hi)
        return 0;
    PyObject *piece = ci_slice(value, lo, hi);
    if (piece == NULL)
        return -1;
    int r = PyList_Append(deferred, piece);
    Py_DECREF(piece);
    return r;
}

/* host_insert(cache, plan, value, units, extra_key, prev, chunked, n, total, page_size,
 *             deferred, owned) -> InsertResult, or None (nothing changed): see above. */
static PyObject *
core_host_insert(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(12, "host_insert(cache, plan, value, units, extra_key, "
         "prev, chunked, n, total, page_size, deferred, owned)");
    PyObject *cache = args[0], *plan = args[1], *value = args[2], *units = args[3],
             *ek = args[4], *chunked = args[6], *deferred = args[10], *owned = args[11];
    static const int ints[4] = {5, 7, 8, 9};
    Py_ssize_t iv[4];
    if (g_hi_tier == NULL || g_pn_type == NULL || g_InsertResult == NULL
            || !ci_ints(args, ints, 4, iv) || (chunked != Py_True && chunked != Py_False)
            || !PyList_CheckExact(plan) || !PyList_CheckExact(deferred))
        Py_RETURN_NONE;
    Py_ssize_t prev = iv[0], n = iv[1], total = iv[2], ps = iv[3];
    if (ps < 1)
        Py_RETURN_NONE;
    KeyView uk;  /* (units: an int64 buffer of n units, whole pages) */
    if (key_view(units, &uk) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t un = uk.n;
    key_release(&uk);
    if (un != n || n % ps)
        Py_RETURN_NONE;
    Py_ssize_t np = PyList_GET_SIZE(plan);
    for (Py_ssize_t i = 0; i < np; i++) {
        PyObject *it = PyList_GET_ITEM(plan, i);
        if (!PyTuple_CheckExact(it) || PyTuple_GET_SIZE(it) != 2
                || !PN_IS(PyTuple_GET_ITEM(it, 0)) || !PyLong_CheckExact(PyTuple_GET_ITEM(it, 1)))
            Py_RETURN_NONE;
    }
    HiCtx x = {cache, NULL, NULL, NULL, 0};
    PyObject *result = NULL, *wb = NULL, *thr = NULL, *node = NULL, *child = NULL,
             *stamp = NULL;
    long long threshold = 0, clock0;
    int hits = 0;
    if ((x.tier = PyObject_GetAttr(cache, s_hi_tier)) == NULL
            || (x.heap = PyObject_GetAttr(cache, s_hi_heap)) == NULL
            || (x.root = PyObject_GetAttr(cache, s_hi_root)) == NULL)
        goto done;
    if (Py_TYPE(x.tier) != g_hi_tier || !PyList_CheckExact(x.heap) || !PN_IS(x.root)) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if ((wb = PyObject_GetAttr(x.tier, s_hi_write_back)) == NULL)
        goto done;
    if (wb != Py_True && wb != Py_False) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    hits = chunked == Py_False && wb == Py_False;
    if (hits) {
        if ((thr = PyObject_GetAttr(x.tier, s_hi_threshold)) == NULL)
            goto done;
        if (!exact_ll(thr, &threshold)) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        if ((x.inline_backup = hi_inline_backup(cache, x.tier)) < 0)
            goto done;
    }
    {
        PyObject *c = PyObject_GetAttr(cache, s_hi_clock);
        if (c == NULL)
            goto done;
        int ok = exact_ll(c, &clock0);
        Py_DECREF(c);
        if (!ok || clock0 > LLONG_MAX / 2) {
            result = Py_NewRef(Py_None);
            goto done;
        }
    }

    /* (from here on, the Python loop's changes) the root's stamp */
    if ((stamp = hi_tick(cache)) == NULL || HI_SET(x.root, last_access_time, s_hi_stamp, stamp) < 0)
        goto done;
    if (n == 0) {
        result = hi_result(0, total);
        goto done;
    }
    node = Py_NewRef(x.root);
    Py_ssize_t pos = 0;
    for (Py_ssize_t i = 0; i < np; i++) {
        Py_ssize_t shared;
        if (hi_plan_at(plan, i, "host_insert", &child, &shared) < 0
                || hi_touch(cache, &x, child, &stamp) < 0 || hi_split_at(cache, &child, shared) < 0)
            goto done;
        Py_ssize_t end = pos + shared;
        int none = hi_is_none(child, PN_OFF(child, PN_value), s_hi_value);
        if (none < 0)
            goto done;
        if (none) {  /* evicted to the host: the fresh slots are its own again */
            PyObject *p = PyLong_FromSsize_t(pos);
            if (p == NULL)
                goto done;
            PyObject *a[4] = {cache, child, value, p};
            int r = discard(PyObject_VectorcallMethod(s_hi_unevict, a,
                                                      4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL));
            Py_DECREF(p);
            if (r < 0)
                goto done;
        } else if (hi_defer(value, deferred, prev > pos ? prev : pos, end) < 0) {
            goto done;  /* (this node's duplicates: one piece per node) */
        }
        /* (``HostTier.count_hit``: child holds device data here) */
        if (hits && hi_hit(&x, child, thr, threshold, 1) < 0)
            goto done;
        Py_SETREF(node, child);
        child = NULL;
        pos = end;
    }
    if (pos < n) {  /* the new leaf */
        PyObject *ck = NULL, *leaf = NULL, *children = NULL, *lv = NULL;
        int ok = 0;
        if ((leaf = hi_leaf_new(cache, units, value, node, ek, pos, n, ps, "host_insert", &stamp,
                                &ck)) == NULL
                || (children = HI_GET(node, children, s_hi_children)) == NULL
                || PyObject_SetItem(children, ck, leaf) < 0
                || pyfield_add(node, PN_OFF(node, PN_dev_children), s_hi_dev_children, 1) < 0
                || pyfield_add(cache, 0, s_hi_evictable, (long long)(n - pos)) < 0)
            goto leaf_done;
        if (owned != Py_None) {  /* (``_own``) */
            if ((lv = HI_GET(leaf, value, s_hi_value)) == NULL
                    || owned_apply(owned, s_hi_update, lv) < 0)
                goto leaf_done;
        }
        if (pn_heap_push(x.heap, stamp, leaf) < 0)
            goto leaf_done;
        if (hits) {  /* (``count_hit`` of the new leaf: it has no host copy) */
            PyObject *one = PyLong_FromLong(1);
            if (one == NULL)
                goto leaf_done;
            int r = HI_SET(leaf, hit_count, s_hi_hit_count, one);
            Py_DECREF(one);
            if (r < 0 || (1 >= threshold && hi_backup(&x, leaf) < 0))
                goto leaf_done;
        }
        ok = 1;
    leaf_done:
        Py_XDECREF(ck);
        Py_XDECREF(leaf);
        Py_XDECREF(children);
        Py_XDECREF(lv);
        if (!ok)
            goto done;
    }
    result = hi_result(pos, total);
done:
    Py_XDECREF(x.tier);
    Py_XDECREF(x.heap);
    Py_XDECREF(x.root);
    Py_XDECREF(wb);
    Py_XDECREF(thr);
    Py_XDECREF(node);
    Py_XDECREF(child);
    Py_XDECREF(stamp);
    return result;
}

/* ---- host tier: one aux component's insert (host_aux_insert) ---- */
/*
 * host_aux_insert: fast/hybrid.py _insert from the root's stamp on, for one stock SWA or Mamba
 * plug-in over the host tier (the ``lru`` order, the stock hooks; fast/host_aux.py
 * insert_host_aux runs _insert's checks, the key, the plan and the component's checks first,
 * in _insert's order, and declines the slot ledger, KV events, a storage tier, a disabled
 * cache and EAGLE keys before calling this).  The same steps in the same order as _insert's
 * general loop for that shape: the root's stamp; each planned node touched (its stamp, the
 * heap push of an unlocked device leaf, or the host heap's entry through the tier's
 * ``restamped`` for an evicted one; its record to the front of the component's list), split
 * where the insert ends inside it (the cache's ``_split``), given the fresh slots back where
 * it was evicted (the cache's ``_unevict``, then SWA's ``recover``), an unlocked SWA
 * tombstone's ``overlap`` from prev_prefix_len on, the caller's duplicates queued on the
 * insert's ``_deferred`` (``_free`` written out: one piece per node), write-through hits
 * counted (the tier's ``write_backup`` called at the threshold); then SWA's ``skips_leaf``
 * (the remainder freed, no leaf), the new leaf (fast/node.py's Node as host_insert makes it,
 * its one AuxData called as ``_new_node`` calls it), the component's commit (SWA: the part
 * before the window split off through ``_split``, the leaf's SWA slots through the
 * component's ``translate``; Mamba: the state, or the node's own to the front and the
 * ``_stamp``), ``AuxComponent.set`` written out, the host leaf's discard and the new leaf's
 * hit.  The calls that do more than field writes (``_split``, ``_unevict``, ``recover``,
 * ``overlap``, ``translate``, ``_stamp``, ``restamped``, ``write_backup``, ``on_set``) are the
 * same Python calls; the cache's _clock is read and written at every tick (hi_tick), so a
 * call that moves it is seen as the Python loop sees it.  It declines (None, nothing
 * changed) where the loop takes what this does not write out: a plan entry that is not
 * (Node with one record, int), units that are not an int64 buffer of n units, a heap or
 * queue that is not a plain list, a tier that is not exactly HostTier, a component whose
 * index is not 0, a clock or threshold that is not a plain int, any error met before the
 * first change.  tests/fast/test_host_aux_insert_twin.py runs it against _insert in
 * lockstep.
 */

static PyObject *s_hai_recover, *s_hai_host_lru, *s_hai_host_leaves, *s_hai_discard, *s_hai_pop;

/* obj.name(*a[0:k]) (a[-1] writable: PY_VECTORCALL_ARGUMENTS_OFFSET), the answer dropped;
 * 0 or -1. */
static int
hai_call(PyObject *obj, PyObject *name, PyObject **a, Py_ssize_t k)
{
    a[0] = obj;
    return discard(PyObject_VectorcallMethod(name, a, k | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL));
}

/* ``AuxComponent.set(node, v)`` written out for node's record rec (units: the component's
 * ``units(node)``): rec.value = v, the list's front, off the host list where it has a host
 * copy, counted by its lock, ``on_set`` where the component tracks slots.  0 or -1. */
static int
hai_set(PyObject *comp, PyObject *head, PyObject *rec, PyObject *v, long long units)
{
    if (AD_SET(rec, value, v) < 0 || lru_link_after(head, rec) < 0)
        return -1;
    PyObject *hv = pyfield_get(rec, AD_OFF(rec, AD_host_value), s_hi_host_value);
    if (hv == NULL)
        return -1;
    int has = hv != Py_None;
    Py_DECREF(hv);
    if (has) {  /* self.host_lru.pop(rec, None) */
        PyObject *hl = PyObject_GetAttr(comp, s_hai_host_lru), *a[3];
        if (hl == NULL)
            return -1;
        int r;
        if (PyDict_CheckExact(hl)) {
            r = PyDict_Contains(hl, rec);
            if (r > 0)
                r = PyDict_DelItem(hl, rec);
        } else {
            a[1] = rec;
            a[2] = Py_None;
            r = hai_call(hl, s_hai_pop, a, 3);
        }
        Py_DECREF(hl);
        if (r < 0)
            return -1;
    }
    PyObject *lk = AD_GET(rec, lock);
    if (lk == NULL)
        return -1;
    int locked = PyObject_IsTrue(lk);
    Py_DECREF(lk);
    if (locked < 0
            || pyfield_add(comp, 0, locked ? s_comp_protected : s_comp_evictable, units) < 0)
        return -1;
    PyObject *tr = PyObject_GetAttr(comp, s_ci_tracks);
    if (tr == NULL)
        return -1;
    int tracks = PyObject_IsTrue(tr);
    Py_DECREF(tr);
    if (tracks < 0)
        return -1;
    if (tracks) {
        PyObject *a[2] = {NULL, v};
        return hai_call(comp, s_ci_on_set, a, 2);
    }
    return 0;
}


/* host_aux_insert(cache, comp, swa, plan, value, units, extra_key, prev, chunked, e, n, total,
 *                 page_size, deferred, prepared) -> InsertResult, or None (nothing changed):
 * see above (swa: comp where it is SWA, else None; prepared: the caller's mamba_value, whose
 * checks and copy, ``mamba_state``'s, are made here before anything changes). */
static PyObject *
core_host_aux_insert(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(15, "host_aux_insert(cache, comp, swa, plan, value, units, extra_key, prev, "
         "chunked, e, n, total, page_size, deferred, prepared)");
    PyObject *cache = args[0], *comp = args[1], *swa = args[2], *plan = args[3],
             *value = args[4], *units = args[5], *ek = args[6], *chunked = args[8],
             *deferred = args[13], *prepared = args[14];
    static const int ints[5] = {7, 9, 10, 11, 12};
    Py_ssize_t iv[5];
    if (s_hai_recover == NULL) {
#define HAI_INTERN(var, s) if ((var = PyUnicode_InternFromString(s)) == NULL) return NULL
        HAI_INTERN(s_hai_recover, "recover");
        HAI_INTERN(s_hai_host_lru, "host_lru");
        HAI_INTERN(s_hai_host_leaves, "host_leaves");
        HAI_INTERN(s_hai_discard, "discard");
        HAI_INTERN(s_hai_pop, "pop");
#undef HAI_INTERN
    }
    if (g_hi_tier == NULL || g_pn_type == NULL || g_ad_type == NULL || g_InsertResult == NULL
            || g_hi_one == NULL || !ci_ints(args, ints, 5, iv)
            || (chunked != Py_True && chunked != Py_False) || !PyList_CheckExact(plan)
            || !PyList_CheckExact(deferred) || (swa != Py_None && swa != comp)
            || (swa == Py_None) == (prepared == Py_None))  /* (SWA: no state; Mamba: one) */
        Py_RETURN_NONE;
    Py_ssize_t prev = iv[0], e = iv[1], n = iv[2], total = iv[3], ps = iv[4];
    int is_swa = swa != Py_None;
    if (ps < 1 || n < 0 || n % ps)
        Py_RETURN_NONE;
    KeyView uk;  /* (units: an int64 buffer of n units) */
    if (key_view(units, &uk) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t un = uk.n;
    key_release(&uk);
    if (un != n)
        Py_RETURN_NONE;
    Py_ssize_t np = PyList_GET_SIZE(plan);
    for (Py_ssize_t i = 0; i < np; i++) {
        PyObject *it = PyList_GET_ITEM(plan, i), *c, *aux;
        if (!PyTuple_CheckExact(it) || PyTuple_GET_SIZE(it) != 2
                || !PN_IS(c = PyTuple_GET_ITEM(it, 0))
                || !PyLong_CheckExact(PyTuple_GET_ITEM(it, 1))
                || (aux = SLOT_AT(c, PN_aux)) == NULL || !PyTuple_CheckExact(aux)
                || PyTuple_GET_SIZE(aux) != 1)
            Py_RETURN_NONE;
    }
    /* Mamba: ``mamba_state``'s checks (an exact int64 tensor of one slot; anything else
     * declined: ``_insert`` raises its error) and copy (the tree's own tensor) */
    PyObject *state = NULL;
    if (!is_swa) {
        Py_ssize_t one = -1;
        if ((PyObject *)Py_TYPE(prepared) != g_Tensor || int64_1d_len(prepared, &one) != 1
                || one != 1 || (state = pi_state_own(mod, prepared)) == NULL) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        prepared = state;
    }
    HiCtx x = {cache, NULL, NULL, NULL, 0};  /* (the tier's own write_backup: a Python call) */
    PyObject *result = NULL, *wb = NULL, *thr = NULL, *lru = NULL, *head = NULL, *node = NULL,
             *child = NULL, *stamp = NULL, *rec = NULL, *target = NULL, *o_prev = args[7],
             *o_e = args[9];
    long long threshold = 0, clock0, ci = -1;
    int hits = 0, is_new = 0, exist = 0;
    /* the reads before the first change: an error or anything unexpected declines */
    if ((x.tier = PyObject_GetAttr(cache, s_hi_tier)) == NULL
            || (x.heap = PyObject_GetAttr(cache, s_hi_heap)) == NULL
            || (x.root = PyObject_GetAttr(cache, s_hi_root)) == NULL
            || Py_TYPE(x.tier) != g_hi_tier || !PyList_CheckExact(x.heap) || !PN_IS(x.root)
            || attr_ll(comp, s_ci_i, &ci) != 1 || ci != 0
            || (lru = PyObject_GetAttr(comp, s_lru)) == NULL
            || (head = PyObject_GetAttr(lru, s_head)) == NULL
            || (wb = PyObject_GetAttr(x.tier, s_hi_write_back)) == NULL
            || (wb != Py_True && wb != Py_False))
        goto decline;
    hits = chunked == Py_False && wb == Py_False;
    if (hits && ((thr = PyObject_GetAttr(x.tier, s_hi_threshold)) == NULL
                 || !exact_ll(thr, &threshold)))
        goto decline;
    {
        PyObject *c = PyObject_GetAttr(cache, s_hi_clock);
        int ok = c != NULL && exact_ll(c, &clock0) && clock0 <= LLONG_MAX / 2;
        Py_XDECREF(c);
        if (!ok)
            goto decline;
    }

    /* (from here on, _insert's changes) the root's stamp */
    if ((stamp = hi_tick(cache)) == NULL
            || HI_SET(x.root, last_access_time, s_hi_stamp, stamp) < 0)
        goto done;
    if (n == 0) {  /* (mamba_exist: bool(self.components)) */
        result = ci_result(0, total, 1);
        goto done;
    }
    node = Py_NewRef(x.root);
    Py_ssize_t pos = 0;
    for (Py_ssize_t i = 0; i < np; i++) {
        Py_ssize_t shared;  /* (``_touch`` written out: then the record to the front) */
        if (hi_plan_at(plan, i, "host_aux_insert", &child, &shared) < 0
                || hi_touch(cache, &x, child, &stamp) < 0)
            goto done;
        Py_XSETREF(rec, pn_rec_at(child, 0));
        int has = rec == NULL ? -1 : rec_holds(rec);
        if (has < 0 || (has && lru_move_after(head, rec) < 0)
                || hi_split_at(cache, &child, shared) < 0)
            goto done;
        Py_ssize_t end = pos + shared, taken = shared;
        int none = hi_is_none(child, PN_OFF(child, PN_value), s_hi_value);
        if (none < 0)
            goto done;
        if (none) {  /* evicted to the host: the fresh slots are its own again */
            PyObject *p = PyLong_FromSsize_t(pos);
            if (p == NULL)
                goto done;
            PyObject *a[4] = {NULL, child, value, p};
            int r = hai_call(cache, s_hi_unevict, a, 4);
            if (r == 0 && is_swa) {  /* with its SWA data inside the window */
                PyObject *b[4] = {NULL, child, p, o_e};
                r = hai_call(swa, s_hai_recover, b, 4);
            }
            Py_DECREF(p);
            if (r < 0)
                goto done;
            taken = 0;
        } else if (is_swa && prev < end) {
            /* a locked SWA tombstone keeps its slots (another holder reads them) */
            Py_XSETREF(rec, pn_rec_at(child, 0));
            int held = rec == NULL ? -1 : rec_holds(rec);
            int free_ = held < 0 ? -1 : held ? 0 : PN_ZERO(child, lock_ref);
            if (free_ < 0)
                goto done;
            if (free_) {
                PyObject *o_pos = PyLong_FromSsize_t(pos), *o_sh = PyLong_FromSsize_t(shared);
                PyObject *t = NULL;
                if (o_pos != NULL && o_sh != NULL) {
                    PyObject *a[7] = {swa, child, o_pos, o_sh, value, o_prev, o_e};
                    t = PyObject_VectorcallMethod(s_ci_overlap, a,
                                                  7 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
                }
                Py_XDECREF(o_pos);
                Py_XDECREF(o_sh);
                if (t == NULL)
                    goto done;
                taken = PyLong_AsSsize_t(t);
                Py_DECREF(t);
                if (taken == -1 && PyErr_Occurred())
                    goto done;
            }
        }
        /* this node's duplicates: one piece per node (``_free``) */
        if (hi_defer(value, deferred, prev > pos ? prev : pos, pos + taken) < 0)
            goto done;
        if (hits && hi_hit(&x, child, thr, threshold, 1) < 0)
            goto done;
        Py_SETREF(node, child);
        child = NULL;
        pos = end;
    }
    target = Py_NewRef(node);
    if (pos < n) {
        if (is_swa && e >= n) {  /* (``skips_leaf``: the remainder wholly outside the window) */
            if (hi_defer(value, deferred, pos, n) == 0)
                result = ci_result(pos, 0, 0);
            goto done;
        }
        PyObject *ck = NULL, *leaf = NULL, *children = NULL, *nrec = NULL, *tup = NULL;
        int ok = 0;
        /* (``_new_node``: the Node, then its one record) */
        if ((leaf = hi_leaf_new(cache, units, value, node, ek, pos, n, ps, "host_aux_insert",
                                &stamp, &ck)) == NULL
                || (nrec = PyObject_CallOneArg((PyObject *)g_ad_type, leaf)) == NULL
                || (tup = PyTuple_Pack(1, nrec)) == NULL
                || HI_SET(leaf, aux, s_aux, tup) < 0
                || (children = HI_GET(node, children, s_hi_children)) == NULL
                || PyObject_SetItem(children, ck, leaf) < 0
                || pyfield_add(node, PN_OFF(node, PN_dev_children), s_hi_dev_children, 1) < 0
                || pyfield_add(cache, 0, s_hi_evictable, (long long)(n - pos)) < 0
                || pn_heap_push(x.heap, stamp, leaf) < 0)  /* (an unlocked, childless leaf) */
            goto leaf_done;
        Py_SETREF(target, Py_NewRef(leaf));
        is_new = 1;
        ok = 1;
    leaf_done:
        Py_XDECREF(ck);
        Py_XDECREF(leaf);
        Py_XDECREF(children);
        Py_XDECREF(nrec);
        Py_XDECREF(tup);
        if (!ok)
            goto done;
    }
    /* the component's commit */
    if (is_swa) {  /* (``SwaComponent.commit``) */
        Py_ssize_t tk = is_new ? pn_key_len(target) : 0;
        if (tk < 0)
            goto done;
        if (is_new && e - pos < tk) {
            if (e - pos > 0) {
                PyObject *k = PyLong_FromSsize_t(e - pos);
                if (k == NULL)
                    goto done;
                PyObject *a[3] = {NULL, target, k};
                int r = hai_call(cache, s_hi_split, a, 3);
                Py_DECREF(k);
                if (r < 0)
                    goto done;
            }
            /* self.set(target, self.translate(target.value)) */
            PyObject *tv = HI_GET(target, value, s_hi_value), *sv = NULL;
            if (tv == NULL)
                goto done;
            {
                PyObject *a[2] = {comp, tv};
                sv = PyObject_VectorcallMethod(s_ci_translate, a,
                                               2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            }
            Py_DECREF(tv);
            if (sv == NULL)
                goto done;
            Py_XSETREF(rec, pn_rec_at(target, 0));
            int r = rec == NULL || (tk = pn_key_len(target)) < 0 ? -1
                : hai_set(comp, head, rec, sv, tk);
            Py_DECREF(sv);
            if (r < 0)
                goto done;
        }
    } else {  /* (``MambaComponent.commit``) */
        Py_XSETREF(rec, pn_rec_at(target, 0));
        int held = rec == NULL ? -1 : rec_holds(rec);
        if (held < 0)
            goto done;
        if (is_new || !held) {
            if (hai_set(comp, head, rec, prepared, 1) < 0)
                goto done;
        } else {
            if (lru_move_after(head, rec) < 0)
                goto done;
            exist = 1;
        }
        if (!is_new) {  /* (``cache._stamp(target)``) */
            PyObject *a[2] = {NULL, target};
            if (hai_call(cache, s_ci_stamp_m, a, 2) < 0)
                goto done;
        }
    }
    if (is_new) {
        /* (``update_host_leaf(node)``: it has a child now, so it is no host leaf) */
        PyObject *hl = PyObject_GetAttr(x.tier, s_hai_host_leaves);
        if (hl == NULL)
            goto done;
        int r;
        if (PySet_CheckExact(hl)) {
            r = PySet_Discard(hl, node);
        } else {
            PyObject *a[2] = {NULL, node};
            r = hai_call(hl, s_hai_discard, a, 2);
        }
        Py_DECREF(hl);
        if (r < 0 || (hits && hi_hit(&x, target, thr, threshold, 0) < 0))
            goto done;
    }
    result = exist ? ci_result(pos, total, 1) : hi_result(pos, total);
    goto done;
decline:
    PyErr_Clear();
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(x.tier);
    Py_XDECREF(x.heap);
    Py_XDECREF(x.root);
    Py_XDECREF(wb);
    Py_XDECREF(thr);
    Py_XDECREF(lru);
    Py_XDECREF(head);
    Py_XDECREF(node);
    Py_XDECREF(child);
    Py_XDECREF(stamp);
    Py_XDECREF(rec);
    Py_XDECREF(target);
    Py_XDECREF(state);
    return result;
}

/* ---- host tier: a host pool's alloc (host_take) ---- */
/*
 * host_take: a backup's `pool.alloc(n)` followed by the copy the caller makes of what it gets
 * (fast/tiers/host.py _take_host, SwaComponent.backup, MambaComponent.backup, host_insert's
 * backup), for sglang 0.5.13.post1's host pools whose alloc is HostKVCache.alloc or
 * MambaPoolHost.alloc (fast/frees.py native_alloc_ok says which classes; nothing set on the
 * instance).  That alloc, under the pool's lock: n a multiple of page_size (else it raises),
 * None when n is above len(free_slots), else free_slots[:n] (a view of the list) with
 * free_slots = free_slots[n:].  The caller keeps not the view (it would keep the whole list
 * alive) but a copy.  Here, with the lock taken without blocking: the same view left as the
 * list, the taken slots written straight into a new int64 tensor (the copy), no view made.
 * Declines (NotImplemented, nothing done: the caller runs pool.alloc) where the pool is not
 * such a class, the lock is held elsewhere, n is not a multiple of page_size, or the list is
 * not a plain CPU int64 tensor.
 */
static PyObject *g_take_ok = NULL;  /* fast/frees.py native_alloc_ok(cls) */
static PyObject *g_take_verdicts = NULL;  /* class -> native_alloc_ok(class), as asked */
static PyObject *s_ht_lock, *s_ht_acquire, *s_ht_release, *s_ht_free_slots, *s_ht_page_size,
    *s_ht_alloc;

/* host_take_setup(native_alloc_ok) */
static PyObject *
core_host_take_setup(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1 || !PyCallable_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "host_take_setup(native_alloc_ok)");
        return NULL;
    }
    if (s_ht_lock == NULL) {
        if ((s_ht_lock = PyUnicode_InternFromString("lock")) == NULL
                || (s_ht_acquire = PyUnicode_InternFromString("acquire")) == NULL
                || (s_ht_release = PyUnicode_InternFromString("release")) == NULL
                || (s_ht_free_slots = PyUnicode_InternFromString("free_slots")) == NULL
                || (s_ht_page_size = PyUnicode_InternFromString("page_size")) == NULL
                || (s_ht_alloc = PyUnicode_InternFromString("alloc")) == NULL)
            return NULL;
    }
    PyObject *verdicts = PyDict_New();
    if (verdicts == NULL)
        return NULL;
    Py_XSETREF(g_take_ok, Py_NewRef(args[0]));
    Py_XSETREF(g_take_verdicts, verdicts);
    Py_RETURN_NONE;
}

/* Whether pool's class is one host_take writes out (asked once per class): 1, 0 or -1. */
static int
host_take_class_ok(PyObject *pool)
{
    PyObject *tp = (PyObject *)Py_TYPE(pool);
    PyObject *v = PyDict_GetItemWithError(g_take_verdicts, tp);  /* borrowed */
    if (v == NULL) {
        if (PyErr_Occurred() || (v = PyObject_CallOneArg(g_take_ok, tp)) == NULL)
            return -1;
        int r = PyDict_SetItem(g_take_verdicts, tp, v);
        Py_DECREF(v);  /* (the dict holds it) */
        if (r < 0)
            return -1;
    }
    return v == Py_True;
}

/* host_take(pool, n) -> a new int64 tensor of the n slots pool.alloc(n) would hand out (the
 * pool's list left as that alloc leaves it), None where the pool is short (nothing taken, as
 * alloc's None), or NotImplemented (declined, nothing done). */
static PyObject *
core_host_take(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(2, "host_take(pool, n)");
    PyObject *pool = args[0];
    long long n, ps;
    if (g_take_ok == NULL || !exact_ll(args[1], &n) || n <= 0)
        Py_RETURN_NOTIMPLEMENTED;
    int ok = host_take_class_ok(pool);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    PyObject **dp = _PyObject_GetDictPtr(pool);  /* nothing of alloc's set on the instance */
    if (dp == NULL || (*dp != NULL && PyDict_GetItemWithError(*dp, s_ht_alloc) != NULL))
        Py_RETURN_NOTIMPLEMENTED;
    if (PyErr_Occurred())
        return NULL;
    PyObject *page = PyObject_GetAttr(pool, s_ht_page_size);
    if (page == NULL)
        return NULL;
    ok = exact_ll(page, &ps);
    Py_DECREF(page);
    if (!ok || ps <= 0 || n % ps)
        Py_RETURN_NOTIMPLEMENTED;  /* (alloc raises: its own message) */
    PyObject *lock = PyObject_GetAttr(pool, s_ht_lock);
    if (lock == NULL)
        return NULL;
    PyObject *got = PyObject_CallMethodOneArg(lock, s_ht_acquire, Py_False);
    if (got == NULL) {
        Py_DECREF(lock);
        return NULL;
    }
    int held = got == Py_True;
    Py_DECREF(got);
    if (!held) {  /* another thread is inside the pool: its alloc waits for it, not this */
        Py_DECREF(lock);
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *result = NULL, *list = PyObject_GetAttr(pool, s_ht_free_slots), *rest = NULL;
    const long long *p;
    Py_ssize_t len;
    if (list == NULL)
        goto done;
    ok = plain_data(list, &p, &len);
    if (ok <= 0) {
        if (ok == 0)
            result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if (n > len) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    long long *dst;
    PyObject *taken = new_int64((Py_ssize_t)n, &dst);
    if (taken == NULL)
        goto done;
    memcpy(dst, p, (size_t)n * sizeof(long long));
    if ((rest = tail_view(list, (Py_ssize_t)n, len)) == NULL
            || PyObject_SetAttr(pool, s_ht_free_slots, rest) < 0) {
        Py_DECREF(taken);
        goto done;
    }
    result = taken;
done:
    Py_XDECREF(list);
    Py_XDECREF(rest);
    {  /* the lock released whatever happened above, the error (if any) kept */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject *r = PyObject_CallMethodNoArgs(lock, s_ht_release);
        Py_DECREF(lock);
        if (r == NULL) {
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(tb);
            Py_CLEAR(result);
            return NULL;
        }
        Py_DECREF(r);
        PyErr_Restore(et, ev, tb);
    }
    return result;
}

/* ---- host tier: Full device evict (host_evict) ---- */
/*
 * host_evict: fast/hybrid.py HybridRadixCache._evict_units(want, None) for the Full component
 * alone over the host tier (no aux component, the lru order, the stock hooks: the caller
 * checks those once, at construction), its loop whole: the leaf heap popped with the liveness
 * test (the entry's stamp still the node's, unlocked, no device child, device data, attached,
 * not passed over in this call), each live leaf through HostTier.evict_leaf written out --
 *  - a leaf with a host copy goes to the host: its value onto the batch's "free" run, its
 *    units counted, the cache's _evictable, its value None, the parent's device-child count,
 *    update_host_leaf (the host leaves and their heap), the parent pushed where it is an
 *    evictable leaf now (_push_if_leaf);
 *  - under write-through a leaf without one is deleted: _delete_leaf (_drop_device and
 *    _detach_leaf with no aux component) and HostTier.delete_tombstones of its parent
 *    (detach of each childless ancestor with nothing on either tier and no locks, then the
 *    first that stays pushed and its host-leaf membership recomputed);
 *  - under write-back a leaf without one is backed up first: where evict_leaf's written-out
 *    case holds (the controller only queues acks, its ack queue empty, the node's id not in
 *    flight) the tier's _take_host (a Python call: it may evict host leaves for room), the
 *    host copy kept (a view cloned), host_tokens; else the tier's write_backup(node,
 *    write_back=True) and writing_check(write_back=True), Python calls; a failed backup passes
 *    the leaf over (pushed again, where still a leaf, after the loop);
 * then writing_check(write_back=True) under write-back (a Python call), the batch released
 * through the cache's _release (also when an error stops the loop, as the Python's
 * `finally`), and the heap compacted where needs_compaction says so (the heap's compact, a
 * Python call).  Returns the tracker [Full units].  It declines (None, nothing changed) unless
 * everything it decides on is the plain case, all read before the first pop: a Node root, the
 * heap a plain list that is the LazyHeap's own, the tier exactly HostTier serving this cache
 * (the cache's _evict_leaf its evict_leaf), the host leaves a set and their heap a LazyHeap's
 * list, no aux component, no eviction policy key, no KV events, no storage tier, no tp group,
 * not disabled, write_back a bool, _evictable and page_size plain ints, want a plain int.  A
 * heap entry that is not (stamp, Node) met half way raises TypeError (fast/hybrid.py makes
 * only those).  tests/fast/test_host_evict_twin.py runs it against the Python loop.
 */

static PyObject *g_he_evict_leaf = NULL, *g_he_batch = NULL, *g_he_kw_wb = NULL;
static PyObject *s_he_policy_key, *s_he_storage_tier, *s_he_leaf_heap, *s_he_evict_leaf,
    *s_he_runs, *s_he_take_host, *s_he_release, *s_he_writing_check, *s_he_compact,
    *s_he_is_leaf, *s_he_host_lock, *s_he_host_lock_ref, *s_he_former_parent, *s_he_base,
    *s_he_clone, *s_he_host_tokens, *s_he_shape, *s_he_ack_only;

/* host_evict_setup(HostTier.evict_leaf, FreeBatch): what the twin stands for and builds. */
static PyObject *
core_host_evict_setup(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyFunction_Check(args[0]) || !PyType_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "host_evict_setup(HostTier.evict_leaf, FreeBatch)");
        return NULL;
    }
    if (s_he_policy_key == NULL) {
#define HE_INTERN(var, s) if ((var = PyUnicode_InternFromString(s)) == NULL) return NULL
        HE_INTERN(s_he_policy_key, "_policy_key");
        HE_INTERN(s_he_storage_tier, "storage_tier");
        HE_INTERN(s_he_leaf_heap, "_leaf_heap");
        HE_INTERN(s_he_evict_leaf, "_evict_leaf");
        HE_INTERN(s_he_runs, "runs");
        HE_INTERN(s_he_take_host, "_take_host");
        HE_INTERN(s_he_release, "_release");
        HE_INTERN(s_he_writing_check, "writing_check");
        HE_INTERN(s_he_compact, "compact");
        HE_INTERN(s_he_is_leaf, "_is_leaf");
        HE_INTERN(s_he_host_lock, "host_lock");
        HE_INTERN(s_he_host_lock_ref, "host_lock_ref");
        HE_INTERN(s_he_former_parent, "former_parent");
        HE_INTERN(s_he_base, "_base");
        HE_INTERN(s_he_clone, "clone");
        HE_INTERN(s_he_host_tokens, "host_tokens");
        HE_INTERN(s_he_shape, "shape");
        HE_INTERN(s_he_ack_only, "ack_only");
#undef HE_INTERN
    }
    if (g_he_kw_wb == NULL) {
        PyObject *name = PyUnicode_InternFromString("write_back");
        if (name == NULL || (g_he_kw_wb = PyTuple_Pack(1, name)) == NULL) {
            Py_XDECREF(name);
            return NULL;
        }
        Py_DECREF(name);
    }
    Py_XSETREF(g_he_evict_leaf, Py_NewRef(args[0]));
    Py_XSETREF(g_he_batch, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

/* One evict's state: the objects the steps read (new references, released at the end). */
typedef struct {
    PyObject *cache, *tier, *root, *heap, *leaves, *entries, *pieces;
    AuxEvict add;      /* (ce_add's batch: add.runs is the FreeBatch's runs) */
    long long full;    /* tracker[0] */
} HeCtx;

/* `not node.children`: 1, 0, -1. */
static int
he_childless(PyObject *node)
{
    PyObject *ch = ce_node_field(node, PN_children, "children");
    if (ch == NULL)
        return -1;
    if (PyDict_CheckExact(ch))
        return PyDict_GET_SIZE(ch) == 0;
    int t = PyObject_IsTrue(ch);
    return t < 0 ? -1 : !t;
}

/* `not node.aux or not any(r.host_lock for r in node.aux)`: 1, 0, -1. */
static int
he_no_aux_host_lock(PyObject *node)
{
    PyObject *aux = ce_node_field(node, PN_aux, "aux");
    if (aux == NULL)
        return -1;
    if (PyTuple_CheckExact(aux) && PyTuple_GET_SIZE(aux) == 0)
        return 1;
    int t = PyObject_IsTrue(aux);
    if (t <= 0)
        return t < 0 ? -1 : 1;
    PyObject *it = PyObject_GetIter(aux), *r;
    if (it == NULL)
        return -1;
    int out = 1;
    while ((r = PyIter_Next(it)) != NULL) {
        PyObject *h = PyObject_GetAttr(r, s_he_host_lock);
        Py_DECREF(r);
        int b = h == NULL ? -1 : PyObject_IsTrue(h);
        Py_XDECREF(h);
        if (b != 0) {
            out = b < 0 ? -1 : 0;
            break;
        }
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : out;
}

/* node into the host leaves with a heap entry of its stamp (host_leaves.add,
 * host_leaf_heap.push), or out of them (discard): `in` says which.  0 or -1. */
static int
he_host_leaf(HeCtx *x, PyObject *node, int in)
{
    if (!in)
        return PySet_Discard(x->leaves, node) < 0 ? -1 : 0;
    if (PySet_Add(x->leaves, node) < 0)
        return -1;
    PyObject *stamp = ce_node_field(node, PN_last_access_time, "last_access_time");
    return stamp == NULL ? -1 : pn_heap_push(x->entries, stamp, node);
}

/* cache._push_if_leaf(node): pushed as (its stamp, it) where an evictable leaf.  0 or -1. */
static int
he_push_if_leaf(HeCtx *x, PyObject *node)
{
    int leaf = ce_is_leaf(node, NULL);
    if (leaf <= 0)
        return leaf;
    PyObject *stamp = pyslot_get(node, PN_last_access_time, "last_access_time");
    return stamp == NULL ? -1 : pn_heap_push(x->heap, stamp, node);
}

/* The leaf's value onto the batch's "free" run, its units counted, cache._evictable less
 * (_drop_device with no aux component, evict_leaf's written-out lines alike).  0 or -1. */
static int
he_drop(HeCtx *x, PyObject *node)
{
    PyObject *value = ce_node_field(node, PN_value, "value");
    if (value == NULL || ce_add(&x->add, s_free, value) < 0)
        return -1;
    Py_ssize_t k = pn_key_len(node);
    if (k < 0)
        return -1;
    x->full += k;
    return pyfield_add(x->cache, 0, s_evictable, -(long long)k);
}

/* parent.dev_children -= 1.  0 or -1. */
static int
he_dev_child_gone(PyObject *parent)
{
    long long dc;
    if (ce_check_node(parent) < 0 || pyslot_ll(parent, PN_dev_children, "dev_children", &dc) < 0)
        return -1;
    return pyslot_set_ll(parent, PN_dev_children, dc - 1);
}

/* A leaf's device data goes (he_drop), its value becomes None; its parent (a new reference),
 * or NULL on error. */
static PyObject *
he_unvalue(HeCtx *x, PyObject *node)
{
    if (he_drop(x, node) < 0)
        return NULL;
    pyslot_set(node, PN_value, Py_None);
    PyObject *parent = ce_node_field(node, PN_parent, "parent");
    return parent == NULL ? NULL : Py_NewRef(parent);
}

/* Under write-through, a leaf without a host copy: _delete_leaf then delete_tombstones of
 * its parent.  0 or -1. */
static int
he_delete(HeCtx *x, PyObject *node)
{
    PyObject *parent = he_unvalue(x, node);  /* (then _detach_leaf) */
    if (parent == NULL)
        return -1;
    int rc = -1;
    PyObject *cur = NULL, *up = NULL;
    PyObject *children = ce_node_field(parent, PN_children, "children");
    PyObject *ck = children == NULL ? NULL : ce_node_field(node, PN_ck, "ck");
    if (ck == NULL || (PyDict_CheckExact(children) ? PyDict_DelItem(children, ck)
                                                   : PyObject_DelItem(children, ck)) < 0)
        goto done;
    pyslot_set(node, PN_parent, Py_None);
    if (he_dev_child_gone(parent) < 0)
        goto done;
    if (parent != x->root) {  /* (_delete_leaf: the parent pushed where it is a leaf now) */
        int z = py_eq_zero(SLOT_AT(parent, PN_dev_children));
        if (z < 0 || (z && he_push_if_leaf(x, parent) < 0))
            goto done;
    }
    /* (delete_tombstones(parent)) */
    cur = Py_NewRef(parent);
    for (;;) {
        if (cur == x->root)
            break;
        int t = he_childless(cur);
        if (t > 0)
            t = pyfield_eq_zero(cur, PN_lock_ref, s_lock_ref);
        if (t > 0)
            t = SLOT_AT(cur, PN_value) == Py_None;
        if (t > 0) {
            PyObject *hv = ce_node_field(cur, PN_host_value, "host_value");
            t = hv == NULL ? -1 : hv == Py_None;
        }
        if (t > 0)
            t = pyfield_eq_zero(cur, PN_host_lock_ref, s_he_host_lock_ref);
        if (t < 0)
            goto done;
        if (!t)
            break;
        up = ce_node_field(cur, PN_parent, "parent");
        if (up == NULL)
            goto done;
        Py_INCREF(up);
        if (up == Py_None) {  /* (``assert up is not None``: only the root has no parent) */
            PyErr_SetNone(PyExc_AssertionError);
            goto done;
        }
        /* (HostTier.detach(cur)) */
        PyObject *uc = ce_node_field(up, PN_children, "children");
        PyObject *cck = uc == NULL ? NULL : ce_node_field(cur, PN_ck, "ck");
        if (cck == NULL || (PyDict_CheckExact(uc) ? PyDict_DelItem(uc, cck)
                                                  : PyObject_DelItem(uc, cck)) < 0)
            goto done;
        pyslot_set(cur, PN_parent, Py_None);
        PyObject *aux = ce_node_field(cur, PN_aux, "aux");
        if (aux == NULL)
            goto done;
        if (!(PyTuple_CheckExact(aux) && PyTuple_GET_SIZE(aux) == 0)) {
            PyObject *it = PyObject_GetIter(aux), *r;
            if (it == NULL)
                goto done;
            while ((r = PyIter_Next(it)) != NULL) {
                int s = PyObject_SetAttr(r, s_he_former_parent, up);
                Py_DECREF(r);
                if (s < 0)
                    break;
            }
            Py_DECREF(it);
            if (PyErr_Occurred())
                goto done;
        }
        if (PySet_Discard(x->leaves, cur) < 0)
            goto done;
        Py_SETREF(cur, up);
        up = NULL;
    }
    if (cur != x->root) {
        if (he_push_if_leaf(x, cur) < 0)
            goto done;
        /* (update_host_leaf(cur): is_host_leaf) */
        int t = SLOT_AT(cur, PN_parent) != Py_None && SLOT_AT(cur, PN_value) == Py_None;
        if (t) {
            PyObject *hv = ce_node_field(cur, PN_host_value, "host_value");
            t = hv == NULL ? -1 : hv != Py_None;
        }
        if (t > 0)
            t = pyfield_eq_zero(cur, PN_host_lock_ref, s_he_host_lock_ref);
        if (t > 0)
            t = he_childless(cur);
        if (t > 0)
            t = he_no_aux_host_lock(cur);
        if (t < 0 || he_host_leaf(x, cur, t) < 0)
            goto done;
    }
    rc = 0;
done:
    Py_DECREF(parent);
    Py_XDECREF(cur);
    Py_XDECREF(up);
    return rc;
}

/* Under write-back, a leaf without a host copy backed up (evict_leaf's first branch): 1 done,
 * 0 the backup failed (nothing changed: the leaf is passed over), -1. */
static int
he_backup(HeCtx *x, PyObject *node)
{
    int rc = -1, plain = 0;
    PyObject *cc = NULL, *v = NULL, *host = NULL, *base = NULL, *hv = NULL, *shape = NULL,
             *n = NULL, *t = NULL, *sum = NULL, *ongoing = NULL;
    /* cc.ack_only and not cc.ack_write_queue and (tp_group, storage, events: None, checked
     * before the loop) and node.id not in self.ongoing_write_through */
    if ((cc = PyObject_GetAttr(x->tier, s_hl_controller)) == NULL
            || (v = PyObject_GetAttr(cc, s_he_ack_only)) == NULL
            || (plain = PyObject_IsTrue(v)) < 0)
        goto done;
    if (plain) {
        Py_SETREF(v, PyObject_GetAttr(cc, s_hl_queue));
        if (v == NULL || (plain = PyObject_IsTrue(v)) < 0)
            goto done;
        plain = !plain;
    }
    if (plain) {
        PyObject *id = ce_node_field(node, PN_id, "id");
        if (id == NULL || (ongoing = PyObject_GetAttr(x->tier, s_hl_ongoing)) == NULL
                || (plain = PySequence_Contains(ongoing, id)) < 0)
            goto done;
        plain = !plain;
    }
    if (plain) {  /* (write_backup then writing_check, with nothing for either to keep) */
        if ((host = PyObject_CallMethodOneArg(x->tier, s_he_take_host, node)) == NULL)
            goto done;
        if (host == Py_None) {
            rc = 0;
            goto done;
        }
        if ((base = PyObject_GetAttr(host, s_he_base)) == NULL)
            goto done;
        hv = base == Py_None ? Py_NewRef(host) : PyObject_CallMethodNoArgs(host, s_he_clone);
        if (hv == NULL || ce_check_node(node) < 0)
            goto done;
        pyslot_set(node, PN_host_value, hv);
        /* self.host_tokens += node.value.shape[0] */
        PyObject *value = ce_node_field(node, PN_value, "value");
        if (value == NULL || (t = PyObject_GetAttr(x->tier, s_he_host_tokens)) == NULL
                || (shape = PyObject_GetAttr(value, s_he_shape)) == NULL
                || (n = PySequence_GetItem(shape, 0)) == NULL
                || (sum = PyNumber_InPlaceAdd(t, n)) == NULL
                || PyObject_SetAttr(x->tier, s_he_host_tokens, sum) < 0)
            goto done;
        rc = 1;
        goto done;
    }
    {  /* self.write_backup(node, write_back=True) == 0: passed over */
        PyObject *a[3] = {x->tier, node, Py_True};
        if ((t = PyObject_VectorcallMethod(s_hi_write_backup, a,
                                           2 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                           g_he_kw_wb)) == NULL)
            goto done;
        int z = PyObject_RichCompareBool(t, s_zero, Py_EQ);
        if (z != 0) {
            rc = z < 0 ? -1 : 0;
            goto done;
        }
        PyObject *b[2] = {x->tier, Py_True};
        if (discard(PyObject_VectorcallMethod(s_he_writing_check, b,
                                              1 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                              g_he_kw_wb)) < 0)
            goto done;
        rc = 1;
    }
done:
    Py_XDECREF(cc);
    Py_XDECREF(v);
    Py_XDECREF(host);
    Py_XDECREF(base);
    Py_XDECREF(hv);
    Py_XDECREF(shape);
    Py_XDECREF(n);
    Py_XDECREF(t);
    Py_XDECREF(sum);
    Py_XDECREF(ongoing);
    return rc;
}

/* A leaf with a host copy goes to the host (evict_leaf's written-out common case).  0, -1. */
static int
he_to_host(HeCtx *x, PyObject *node)
{
    PyObject *parent = he_unvalue(x, node);
    if (parent == NULL)
        return -1;
    int rc = -1;
    if (he_dev_child_gone(parent) < 0)
        goto done;
    /* (update_host_leaf, written out: attached, evicted now, backed up) */
    int t = pyfield_eq_zero(node, PN_host_lock_ref, s_he_host_lock_ref);
    if (t > 0)
        t = he_childless(node);
    if (t > 0)
        t = he_no_aux_host_lock(node);
    if (t < 0 || he_host_leaf(x, node, t) < 0 || he_push_if_leaf(x, parent) < 0)
        goto done;
    rc = 0;
done:
    Py_DECREF(parent);
    return rc;
}

/* What host_evict decides on, all read before its first change: 1 (the context's objects
 * set, new references), 0 to decline, -1.  ncomp: the aux components the cache must have (0;
 * host_aux_evict's 1, which it checks further itself). */
static int
he_prepare(HeCtx *x, int *write_back, Py_ssize_t ncomp)
{
    PyObject *cache = x->cache, *v = NULL, *lh = NULL, *el = NULL;
    int ok = 0;
#define HE_READ(o, name) do { Py_XSETREF(v, PyObject_GetAttr((o), (name))); \
        if (v == NULL) goto fail; } while (0)
    HE_READ(cache, s_hl_components);
    if (!PyTuple_CheckExact(v) || PyTuple_GET_SIZE(v) != ncomp)
        goto done;
    HE_READ(cache, s_he_policy_key);
    if (v != Py_None)
        goto done;
    HE_READ(cache, s_events);
    if (v != Py_None)
        goto done;
    HE_READ(cache, s_he_storage_tier);
    if (v != Py_None)
        goto done;
    HE_READ(cache, s_disable);
    if (v != Py_False)
        goto done;
    long long ll;
    HE_READ(cache, s_evictable);
    if (!exact_ll(v, &ll))
        goto done;
    HE_READ(cache, s_page_size);
    if (!exact_ll(v, &ll) || ll < 1)
        goto done;
    int r = hl_root_heap(cache, &x->root, &x->heap);
    if (r <= 0) {
        ok = r;
        goto done;
    }
    if ((lh = PyObject_GetAttr(cache, s_he_leaf_heap)) == NULL)
        goto fail;
    if ((PyObject *)Py_TYPE(lh) != g_hl_lazy_heap)
        goto done;
    HE_READ(lh, s_hl_entries);
    if (v != x->heap)
        goto done;
    if ((r = hl_own_tier(cache, &x->tier)) <= 0) {
        ok = r;
        goto done;
    }
    if ((el = PyObject_GetAttr(cache, s_he_evict_leaf)) == NULL)
        goto fail;
    if (!PyMethod_Check(el) || PyMethod_GET_FUNCTION(el) != g_he_evict_leaf
            || PyMethod_GET_SELF(el) != x->tier)
        goto done;
    HE_READ(x->tier, s_hl_storage);
    if (v != Py_None)
        goto done;
    HE_READ(x->tier, s_hl_tp_group);
    if (v != Py_None)
        goto done;
    HE_READ(x->tier, s_hi_write_back);
    if (v != Py_True && v != Py_False)
        goto done;
    *write_back = v == Py_True;
    if (hl_host_heap(x->tier, &x->leaves, &x->entries) < 0)
        goto fail;
    if (x->leaves == NULL)
        goto done;
    ok = 1;
    goto done;
fail:
    ok = -1;
done:
#undef HE_READ
    Py_XDECREF(v);
    Py_XDECREF(lh);
    Py_XDECREF(el);
    return ok;
}

/* One entry off the leaf heap (the loop's pop and liveness test: the entry's stamp still the
 * node's, an evictable leaf, not passed over in this call): 1 with *node (a new reference),
 * 0 for a stale entry, -1. */
static int
he_pop(HeCtx *x, PyObject *passed, PyObject **node)
{
    PyObject *e = ce_heappop(x->heap);
    if (e == NULL)
        return -1;
    if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 2) {
        Py_DECREF(e);
        PyErr_SetString(PyExc_TypeError, "evict: a leaf heap entry that is not (stamp, node)");
        return -1;
    }
    PyObject *n = Py_NewRef(PyTuple_GET_ITEM(e, 1));
    int live = ce_is_leaf(n, PyTuple_GET_ITEM(e, 0));
    Py_DECREF(e);
    if (live > 0 && passed != NULL)  /* (a leaf passed over in this call: not again) */
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(passed); i++)
            if (PyList_GET_ITEM(passed, i) == n) {
                live = 0;
                break;
            }
    if (live <= 0) {
        Py_DECREF(n);
        return live;
    }
    *node = n;
    return 1;
}

/* After the loops: the leaves passed over pushed again where still leaves, then under
 * write-back self.tier.writing_check(write_back=True).  0 or -1. */
static int
he_after_loop(HeCtx *x, PyObject *passed, int write_back)
{
    if (passed != NULL)
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(passed); i++)
            if (he_push_if_leaf(x, PyList_GET_ITEM(passed, i)) < 0)
                return -1;
    if (write_back) {
        PyObject *b[2] = {x->tier, Py_True};
        if (discard(PyObject_VectorcallMethod(s_he_writing_check, b,
                                              1 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                              g_he_kw_wb)) < 0)
            return -1;
    }
    return 0;
}

/* The end of an evict after its loop (host_evict's, host_aux_evict's): `finally:
 * self._release(batch)` (the loop's error, if any, kept unless the release raises its own),
 * then, where the loop did not fail, the heap compacted where
 * self._leaf_heap.needs_compaction(self._evictable // self.page_size) says so.  0, or -1 with
 * an error (the loop's or its own). */
static int
he_finish(HeCtx *x, PyObject *batch, int failed)
{
    {  /* finally: self._release(batch), the error (if any) kept unless it raises its own */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        if (discard(PyObject_CallMethodOneArg(x->cache, s_he_release, batch)) < 0) {
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(tb);
            return -1;
        }
        PyErr_Restore(et, ev, tb);
    }
    if (failed)
        return -1;
    long long ev, ps;  /* self._leaf_heap.needs_compaction(...), compact */
    if (get_ll(x->cache, s_evictable, &ev) < 0 || get_ll(x->cache, s_page_size, &ps) < 0)
        return -1;
    if (ps == 0) {
        PyErr_SetString(PyExc_ZeroDivisionError, "integer division or modulo by zero");
        return -1;
    }
    long long live = ev / ps;
    if ((ev % ps != 0) && ((ev < 0) != (ps < 0)))
        live--;
    Py_ssize_t n = PyList_GET_SIZE(x->heap);
    if (n > 64 && (long long)n > 4 * (live + 16)) {
        PyObject *lh = PyObject_GetAttr(x->cache, s_he_leaf_heap);
        PyObject *is_leaf = lh == NULL ? NULL : PyObject_GetAttr(x->cache, s_he_is_leaf);
        int c = is_leaf == NULL ? -1
            : discard(PyObject_CallMethodOneArg(lh, s_he_compact, is_leaf));
        Py_XDECREF(lh);
        Py_XDECREF(is_leaf);
        if (c < 0)
            return -1;
    }
    return 0;
}

/* host_evict(cache, want) -> [Full units freed] (_evict_units(want)'s tracker), or None
 * (nothing changed): see above. */
static PyObject *
core_host_evict(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(2, "host_evict(cache, want)");
    long long want;
    if (g_he_evict_leaf == NULL || g_hl_tier == NULL || g_hi_tier == NULL || g_pn_type == NULL
            || !exact_ll(args[1], &want))
        Py_RETURN_NONE;
    HeCtx x;
    memset(&x, 0, sizeof(x));
    x.cache = args[0];
    int write_back = 0;
    PyObject *batch = NULL, *passed = NULL, *result = NULL;
    int r = he_prepare(&x, &write_back, 0);
    if (r <= 0) {
        if (r == 0)
            result = Py_NewRef(Py_None);
        goto out;
    }
    if ((batch = PyObject_CallNoArgs(g_he_batch)) == NULL
            || (x.add.runs = PyObject_GetAttr(batch, s_he_runs)) == NULL)
        goto out;
    if (!PyList_CheckExact(x.add.runs) || PyList_GET_SIZE(x.add.runs) != 0) {
        result = Py_NewRef(Py_None);
        goto out;
    }
    /* (from here on, the Python loop's changes; a failure still releases the batch) */
    int failed = 1;
    while (x.full < want && PyList_GET_SIZE(x.heap) > 0) {
        PyObject *node;
        int live = he_pop(&x, passed, &node);
        if (live < 0)
            goto release;
        if (live == 0)
            continue;
        /* (evict_leaf) */
        int step;
        if (SLOT_AT(node, PN_host_value) == NULL) {
            step = -1;
            PyErr_SetString(PyExc_AttributeError, "'Node' object has no attribute 'host_value'");
        } else if (SLOT_AT(node, PN_host_value) != Py_None) {
            step = he_to_host(&x, node);
        } else if (!write_back) {
            step = he_delete(&x, node);
        } else {
            step = he_backup(&x, node);
            if (step > 0)
                step = he_to_host(&x, node);
            else if (step == 0) {  /* passed over */
                if ((passed == NULL && (passed = PyList_New(0)) == NULL)
                        || PyList_Append(passed, node) < 0)
                    step = -1;
            }
        }
        Py_DECREF(node);
        if (step < 0)
            goto release;
    }
    if (he_after_loop(&x, passed, write_back) < 0)
        goto release;
    failed = 0;
release:
    if (he_finish(&x, batch, failed) < 0)
        goto out;
    {
        PyObject *f = PyLong_FromLongLong(x.full);
        if (f != NULL) {
            result = PyList_New(1);
            if (result == NULL)
                Py_DECREF(f);
            else
                PyList_SET_ITEM(result, 0, f);
        }
    }
out:
    Py_XDECREF(x.tier);
    Py_XDECREF(x.root);
    Py_XDECREF(x.heap);
    Py_XDECREF(x.leaves);
    Py_XDECREF(x.entries);
    Py_XDECREF(x.add.runs);
    Py_XDECREF(batch);
    Py_XDECREF(passed);
    return result;
}

/* ---- host tier: one aux component's device evict (host_aux_evict) ---- */
/*
 * host_aux_evict: fast/hybrid.py HybridRadixCache._evict_units(want, wants) for a host tier
 * with exactly one aux component, the stock SWA or Mamba plug-in (fast/components/), the lru
 * order and the stock hooks (the caller checks those once, at construction:
 * _pick_fast_paths), its steps whole and in its order:
 *  - the leaf heap popped as host_evict pops it (he_pop), each live leaf through
 *    HostTier.evict_leaf (hae_evict_leaf): a leaf with a host copy goes to the host, under
 *    write-through one without is deleted (_delete_leaf, delete_tombstones), under
 *    write-back one without is backed up first (he_backup: the tier's _take_host, which runs
 *    the component's backup, a Python call; or write_backup and writing_check) and passed
 *    over where that fails -- host_evict's steps (he_to_host, he_delete), each after the
 *    component's part of cache._drop_device: where the leaf's record holds data,
 *    comp.drop(node, tracker, batch, True) (hae_drop);
 *  - then comp.drive(wants[comp.name], ...): the component's LRU list from its oldest record
 *    while its units are short (ce_drive, the cevict section's walk), each record not locked:
 *    its node through cache._evict_leaf (hae_evict_leaf again; a failed write-back backup
 *    leaves it as it is) where it is an evictable leaf, else comp.drop(node, ..., False)
 *    (SWA: the node's Full slots as a "free_swa" run; Mamba: its state) -- the cascade that
 *    follows changes nothing with one component;
 *  - the passed-over leaves pushed again, write-back's writing_check, the batch released, the
 *    heap compacted (he_after_loop, he_finish).
 * comp.drop written out: its units (SWA: the key's length; Mamba: 1) counted, comp.evictable
 * less (written at once: Python code the loop calls may read it), the record unlinked from
 * the list, its data queued on the batch (a Mamba state onto batch.states; an SWA leaf's slots
 * go with its Full slots), its value None, and the record onto the host list
 * (comp.host_lru[rec] = None: a record listed already keeps its place) where it keeps a host
 * copy that is not host-locked.
 * Returns the tracker [Full units, the component's units].  It declines (None, nothing
 * changed) before its first pop wherever host_evict's prepare does (he_prepare: one
 * component instead of none) and where the component is not exactly SwaComponent or
 * MambaComponent at index 0 with an int counter and a dict host list, the cache's _pair is
 * set, the batch is not the plain one, or an amount is not a non-negative int.
 * tests/fast/test_host_aux_evict_twin.py runs it against the Python path.
 */

static PyObject *g_hae_swa = NULL, *g_hae_mamba = NULL;
static PyObject *s_hae_states, *s_hae_host_lru, *s_hae_i, *s_hae_pair;

/* host_aux_evict_setup(SwaComponent, MambaComponent): the component classes it writes out. */
static PyObject *
core_host_aux_evict_setup(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyType_Check(args[0]) || !PyType_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "host_aux_evict_setup(SwaComponent, MambaComponent)");
        return NULL;
    }
    if (s_hae_states == NULL) {
        if ((s_hae_states = PyUnicode_InternFromString("states")) == NULL
                || (s_hae_host_lru = PyUnicode_InternFromString("host_lru")) == NULL
                || (s_hae_i = PyUnicode_InternFromString("i")) == NULL
                || (s_hae_pair = PyUnicode_InternFromString("_pair")) == NULL)
            return NULL;
    }
    Py_XSETREF(g_hae_swa, Py_NewRef(args[0]));
    Py_XSETREF(g_hae_mamba, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

/* One evict's state: host_evict's, and the component's (new references). */
typedef struct {
    HeCtx he;
    PyObject *comp, *states, *host_lru;
    int is_swa, write_back;
    long long units;  /* tracker[1] */
} HaeCtx;

/* comp.drop(node, tracker, batch, leaf) of the stock plug-in (see above), `rec` node.aux[0]
 * (an AuxData holding data).  0 or -1. */
static int
hae_drop(HaeCtx *x, PyObject *node, PyObject *rec, int leaf)
{
    Py_ssize_t k = 1;
    if (x->is_swa && (k = pn_key_len(node)) < 0)
        return -1;
    x->units += k;
    if (pyfield_add(x->comp, 0, s_comp_evictable, -(long long)k) < 0 || ce_unlink(rec) < 0)
        return -1;
    if (x->is_swa) {  /* (queue_free: a tombstone's SWA slots; a leaf's go with its Full) */
        if (!leaf) {
            PyObject *value = ce_node_field(node, PN_value, "value");
            if (value == NULL || ce_add(&x->he.add, s_free_swa, value) < 0)
                return -1;
        }
    } else {
        PyObject *state = pyslot_get(rec, AD_value, "value");
        if (state == NULL || PyList_Append(x->states, state) < 0)
            return -1;
    }
    pyslot_set(rec, AD_value, Py_None);
    PyObject *hv = pyslot_get(rec, AD_host_value, "host_value");
    if (hv == NULL)
        return -1;
    if (hv == Py_None)
        return 0;
    PyObject *hl = pyslot_get(rec, AD_host_lock, "host_lock");
    int z = hl == NULL ? -1 : py_eq_zero(hl);
    if (z <= 0)
        return z;
    return PyDict_SetItem(x->host_lru, rec, Py_None);
}

/* cache._drop_device's component part: comp.drop(node, ..., True) where the leaf's record
 * holds data.  0 or -1. */
static int
hae_drop_device(HaeCtx *x, PyObject *node)
{
    PyObject *rec = ce_rec(node);
    if (rec == NULL)
        return -1;
    int rc = 0;
    PyObject *v = pyslot_get(rec, AD_value, "value");
    if (v == NULL)
        rc = -1;
    else if (v != Py_None)
        rc = hae_drop(x, node, rec, 1);
    Py_DECREF(rec);
    return rc;
}

/* HostTier.evict_leaf(node, tracker, batch) with the component: 1 evicted, 0 its write-back
 * backup failed (nothing changed), -1. */
static int
hae_evict_leaf(HaeCtx *x, PyObject *node)
{
    PyObject *hv = ce_node_field(node, PN_host_value, "host_value");
    if (hv == NULL)
        return -1;
    if (hv == Py_None) {
        if (!x->write_back)  /* (_delete_leaf, then delete_tombstones of its parent) */
            return hae_drop_device(x, node) < 0 || he_delete(&x->he, node) < 0 ? -1 : 1;
        int b = he_backup(&x->he, node);
        if (b <= 0)
            return b;
    }
    return hae_drop_device(x, node) < 0 || he_to_host(&x->he, node) < 0 ? -1 : 1;
}

/* comp.drive's step on record x (not locked): its node through cache._evict_leaf where an
 * evictable leaf, else the component's data dropped (the cascade: nothing, one component). */
static int
hae_drive_step(void *ctx, PyObject *rec)
{
    HaeCtx *x = (HaeCtx *)ctx;
    PyObject *node = pyslot_get(rec, AD_node, "node");
    if (node == NULL)
        return -1;
    Py_INCREF(node);
    int rc = ce_check_node(node);
    int leaf = rc < 0 ? -1 : ce_is_leaf(node, NULL);
    if (leaf > 0) {
        rc = hae_evict_leaf(x, node) < 0 ? -1 : 0;
    } else if (leaf == 0) {
        PyObject *r = ce_rec(node);
        rc = r == NULL ? -1 : hae_drop(x, node, r, 0);
        Py_XDECREF(r);
    } else {
        rc = -1;
    }
    Py_DECREF(node);
    return rc;
}

/* What host_aux_evict decides on beyond he_prepare's, read before its first change: 1 (comp,
 * host_lru set, new references; is_swa), 0 to decline, -1. */
static int
hae_prepare(HaeCtx *x)
{
    PyObject *v = PyObject_GetAttr(x->he.cache, s_hae_pair), *comp = NULL;
    if (v == NULL)
        return -1;
    int ok = v == Py_None;
    Py_DECREF(v);
    if (!ok)
        return 0;
    if ((v = PyObject_GetAttr(x->he.cache, s_hl_components)) == NULL)
        return -1;
    ok = 0;
    if (PyTuple_CheckExact(v) && PyTuple_GET_SIZE(v) == 1) {
        comp = Py_NewRef(PyTuple_GET_ITEM(v, 0));
        ok = (PyObject *)Py_TYPE(comp) == g_hae_swa || (PyObject *)Py_TYPE(comp) == g_hae_mamba;
    }
    Py_DECREF(v);
    long long ll;
    if (ok)
        ok = attr_ll(comp, s_hae_i, &ll);
    if (ok > 0 && ll != 0)
        ok = 0;
    if (ok > 0)
        ok = attr_ll(comp, s_comp_evictable, &ll);
    if (ok > 0) {
        if ((v = PyObject_GetAttr(comp, s_hae_host_lru)) == NULL)
            ok = -1;
        else if (!PyDict_CheckExact(v)) {
            Py_CLEAR(v);
            ok = 0;
        }
    }
    if (ok <= 0) {
        Py_XDECREF(comp);
        return ok;
    }
    x->comp = comp;
    x->host_lru = v;
    x->is_swa = (PyObject *)Py_TYPE(comp) == g_hae_swa;
    return 1;
}

/* host_aux_evict(cache, want, aux_want) -> [Full units, the component's units]
 * (_evict_units(want, wants)'s tracker, aux_want the component's want), or None (nothing
 * changed): see above. */
static PyObject *
core_host_aux_evict(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(3, "host_aux_evict(cache, want, aux_want)");
    long long want = ce_amount(args[1]), aux_want = ce_amount(args[2]);
    if (g_he_evict_leaf == NULL || g_hae_swa == NULL || g_hl_tier == NULL || g_hi_tier == NULL
            || g_pn_type == NULL || g_ad_type == NULL || want < 0 || aux_want < 0)
        Py_RETURN_NONE;
    HaeCtx x;
    memset(&x, 0, sizeof(x));
    x.he.cache = args[0];
    PyObject *batch = NULL, *passed = NULL, *result = NULL;
    int r = he_prepare(&x.he, &x.write_back, 1);
    if (r > 0)
        r = hae_prepare(&x);
    if (r <= 0) {
        if (r == 0)
            result = Py_NewRef(Py_None);
        goto out;
    }
    if ((batch = PyObject_CallNoArgs(g_he_batch)) == NULL
            || (x.he.add.runs = PyObject_GetAttr(batch, s_he_runs)) == NULL
            || (x.states = PyObject_GetAttr(batch, s_hae_states)) == NULL)
        goto out;
    if (!PyList_CheckExact(x.he.add.runs) || PyList_GET_SIZE(x.he.add.runs) != 0
            || !PyList_CheckExact(x.states) || PyList_GET_SIZE(x.states) != 0) {
        result = Py_NewRef(Py_None);
        goto out;
    }
    /* (from here on, the Python path's changes; a failure still releases the batch) */
    int failed = 1;
    while (x.he.full < want && PyList_GET_SIZE(x.he.heap) > 0) {
        PyObject *node;
        int live = he_pop(&x.he, passed, &node);
        if (live < 0)
            goto release;
        if (live == 0)
            continue;
        int step = hae_evict_leaf(&x, node);
        if (step == 0 && ((passed == NULL && (passed = PyList_New(0)) == NULL)
                          || PyList_Append(passed, node) < 0))  /* (passed over) */
            step = -1;
        Py_DECREF(node);
        if (step < 0)
            goto release;
    }
    if (ce_drive(x.comp, aux_want, &x.units, hae_drive_step, &x) < 0
            || he_after_loop(&x.he, passed, x.write_back) < 0)
        goto release;
    failed = 0;
release:
    if (he_finish(&x.he, batch, failed) < 0)
        goto out;
    result = Py_BuildValue("[LL]", x.he.full, x.units);
out:
    Py_XDECREF(x.he.tier);
    Py_XDECREF(x.he.root);
    Py_XDECREF(x.he.heap);
    Py_XDECREF(x.he.leaves);
    Py_XDECREF(x.he.entries);
    Py_XDECREF(x.he.add.runs);
    Py_XDECREF(x.comp);
    Py_XDECREF(x.states);
    Py_XDECREF(x.host_lru);
    Py_XDECREF(batch);
    Py_XDECREF(passed);
    return result;
}

static PyMethodDef core_methods[] = {
    {"setup_pynode", (PyCFunction)(void (*)(void))core_setup_pynode, METH_FASTCALL,
     "setup_pynode(Node, AuxData, _Sentinel): the slot offsets the composed tree's C paths use"},
    {"pynode_get", (PyCFunction)(void (*)(void))core_pynode_get, METH_FASTCALL,
     "pynode_get(obj, name) -> the field as the C paths read it (tests)"},
    {"setup", (PyCFunction)core_setup, METH_VARARGS,
     "setup(narrow_copy, cat, stride): the torch callables and the clock step."},
    {"match", (PyCFunction)(void (*)(void))core_match, METH_FASTCALL,
     "match(cache, units, extra_key) -> (indices or None, node)"},
    {"insert", (PyCFunction)(void (*)(void))core_insert, METH_FASTCALL,
     "insert(cache, units, extra_key, value, prev_prefix_len) -> prefix_len"},
    {"inc_lock", (PyCFunction)(void (*)(void))core_inc_lock, METH_FASTCALL,
     "inc_lock(root, node) -> (delta, skipped ids or None)"},
    {"dec_lock", (PyCFunction)(void (*)(void))core_dec_lock, METH_FASTCALL,
     "dec_lock(root, node, skip, heap) -> delta, or -1 if the path is not locked"},
    {"evict", (PyCFunction)(void (*)(void))core_evict, METH_FASTCALL,
     "evict(cache, num_tokens) -> tokens evicted"},
    {"paged_front", (PyCFunction)(void (*)(void))core_paged_front, METH_FASTCALL,
     "paged_front(pieces, page_size) -> bytearray of int64: the pages k sorted-prepend "
     "paged frees put in front of the free list, the last piece's first; None if a piece is "
     "not a contiguous 1-D int64 CPU torch.Tensor"},
    {"probing", (PyCFunction)core_probing, METH_NOARGS,
     "probing() -> whether child lookups at page size > 1 probe without building the key"},
    {"page_hash", (PyCFunction)(void (*)(void))core_page_hash, METH_FASTCALL,
     "page_hash(array, extra_key) -> hash of the child key as the C lookup computes it, or None"},
    {"token_array", (PyCFunction)core_token_array, METH_O,
     "token_array(list) -> array('q') of its ints, or None where an item is not exactly an "
     "int in int64 (the Python conversion answers)"},
    {"heappush", (PyCFunction)(void (*)(void))core_heappush, METH_FASTCALL,
     "heappush(list, entry): the heap push the C paths use (for tests)."},
    {"heappop", (PyCFunction)(void (*)(void))core_heappop, METH_FASTCALL,
     "heappop(list): the heap pop the C paths use (for tests)."},
    {"native_release", (PyCFunction)(void (*)(void))core_native_release, METH_FASTCALL,
     "native_release(holder, alloc, pieces) -> whether the pieces went straight into sglang's "
     "exact allocator (as one free each would leave it); False: nothing changed.  holder None: "
     "the allocator's own (fast/frees.py tail_holder, once setup_swa_frees has run)"},
    {"swa_take", (PyCFunction)(void (*)(void))core_swa_take, METH_FASTCALL,
     "swa_take(mapping, pieces) -> (the SWA slots free_swa of each piece in turn frees, how "
     "many each piece gave), mapping zeroed there; or None where sglang's own method must run "
     "(nothing changed)"},
    {"free_timer", (PyCFunction)core_free_timer, METH_O,
     "free_timer(clock) -> seconds spent in the native frees since the last call (then reset); "
     "clock 0 stops timing them, 1 times them on CLOCK_MONOTONIC (time.perf_counter), 2 on "
     "this thread's CPU time (time.thread_time)"},
    {"setup_frees", (PyCFunction)core_setup_frees, METH_VARARGS,
     "setup_frees(torch.empty, native_kind): the native frees into sglang's exact allocators "
     "(native_kind(cls) -> 0 none, 1 appending TokenToKVPoolAllocator, 2 paged, 3 "
     "MambaSlotAllocator, 4 a host pool)"},
    {"setup_api", (PyCFunction)core_setup_api, METH_VARARGS,
     "setup_api(RadixKey, MatchResult, InsertResult, IncLockRefResult, DecLockRefResult, "
     "EvictResult, torch.Tensor, torch.int64, array.array)"},
    {"api_match", (PyCFunction)(void (*)(void))api_match, METH_FASTCALL,
     "api_match(cache, params) -> MatchResult, or None when the Python path must run"},
    {"api_insert", (PyCFunction)(void (*)(void))api_insert, METH_FASTCALL,
     "api_insert(cache, params) -> InsertResult, or None when the Python path must run"},
    {"api_inc", (PyCFunction)(void (*)(void))api_inc, METH_FASTCALL,
     "api_inc(cache, node) -> IncLockRefResult, or None when the Python path must run"},
    {"api_dec", (PyCFunction)(void (*)(void))api_dec, METH_FASTCALL,
     "api_dec(cache, node, params) -> DecLockRefResult, or None when the Python path must run"},
    {"api_evict", (PyCFunction)(void (*)(void))api_evict, METH_FASTCALL,
     "api_evict(cache, params) -> EvictResult, or None when the Python path must run"},
    {"match_step", (PyCFunction)(void (*)(void))core_match_step, METH_FASTCALL,
     "match_step(children, units, pos, n, page_size, extra_key) -> (child, k, split) or the "
     "no-step tuple: fast/keys.py match_step_py, for array('q') units and keys"},
    {"match_step_setup", (PyCFunction)(void (*)(void))core_match_step_setup, METH_FASTCALL,
     "match_step_setup(fallback, no_step): match_step's Python definition (called for what it "
     "does not take) and its no-step answer"},
    {"swa_free", (PyCFunction)(void (*)(void))core_swa_free, METH_FASTCALL,
     "swa_free(alloc, pieces, only_swa) -> whether sglang's exact SWA allocator was left as "
     "free (only_swa: free_swa) of each piece in turn leaves it, in one call (fast/frees.py "
     "swa_release's steps); False: nothing changed"},
    {"setup_swa_frees", (PyCFunction)(void (*)(void))core_setup_swa_frees, METH_FASTCALL,
     "setup_swa_frees(swa_class_ok, tail_holder): swa_free's class check and the "
     "sub-allocators' tail holders (fast/frees.py)"},
    {"tail_spares", (PyCFunction)core_tail_spares, METH_NOARGS,
     "tail_spares() -> the lengths (int64 items) of the retired tail-buffer blocks kept for "
     "the next buffers (fast/_core.c \"tail buffer memory\")"},
    {"swa_gather", (PyCFunction)(void (*)(void))core_swa_gather, METH_FASTCALL,
     "swa_gather(mapping, full) -> mapping[full] as a new int64 tensor (sglang's SWA map read "
     "directly), or None where sglang's own method must run"},
    {"swa_leaf", (PyCFunction)(void (*)(void))core_swa_leaf, METH_FASTCALL,
     "swa_leaf(value, start, length, mapping) -> (value[start:start + length] copied, mapping "
     "at those slots), each a new int64 tensor, or None where the Python path must run"},
    {"setup_clock", (PyCFunction)(void (*)(void))core_setup_clock, METH_FASTCALL,
     "setup_clock(IncLockRefResult, DecLockRefResult, DecLockRefParams, NodeNotFound, "
     "HandleError, SWA_ID, MAMBA_ID, SWA_SPLIT_EPOCH): what clock_inc and clock_dec use"},
    {"clock_inc", (PyCFunction)(void (*)(void))core_clock_inc, METH_FASTCALL,
     "clock_inc(cache, node) -> fast/one_aux.py inc_lock_one's result, or None where the "
     "Python path must run"},
    {"pair_inc", (PyCFunction)(void (*)(void))core_pair_inc, METH_FASTCALL,
     "pair_inc(cache, node) -> fast/hybrid.py inc_lock_ref's result on its general path for "
     "the stock SWA and Mamba plug-ins together, or None where that path must run"},
    {"pair_dec", (PyCFunction)(void (*)(void))core_pair_dec, METH_FASTCALL,
     "pair_dec(cache, node, params) -> fast/hybrid.py dec_lock_ref's result on its general "
     "path for the stock SWA and Mamba plug-ins together, or None where that path must run"},
    {"clock_dec", (PyCFunction)(void (*)(void))core_clock_dec, METH_FASTCALL,
     "clock_dec(cache, node, params) -> fast/one_aux.py dec_lock_one's result, or None where "
     "the Python path must run"},
    {"one_match", (PyCFunction)(void (*)(void))core_one_match, METH_FASTCALL,
     "one_match(cache, params) -> fast/one_aux.py match_one's "
     "MatchResult, or None (nothing changed) where the Python function must run"},
    {"pair_match", (PyCFunction)(void (*)(void))core_pair_match, METH_FASTCALL,
     "pair_match(cache, params) -> fast/hybrid.py match_prefix's MatchResult for the stock "
     "SWA and Mamba plug-ins together, or None (nothing changed) where the general path "
     "must run"},
    {"one_match_setup", (PyCFunction)(void (*)(void))core_one_match_setup, METH_FASTCALL,
     "one_match_setup(heappush): heapq.heappush, for one_match's push onto a heap that is "
     "not a list"},
    {"aux_evict_swa", (PyCFunction)(void (*)(void))core_aux_evict_swa, METH_FASTCALL,
     "aux_evict_swa(cache, comp, want, swa_want, runs) -> (Full units, SWA units): fast/one_aux.py "
     "evict_swa's loops, the frees added to runs (a FreeBatch's); None: declined, nothing changed"},
    {"aux_evict_mamba", (PyCFunction)(void (*)(void))core_aux_evict_mamba, METH_FASTCALL,
     "aux_evict_mamba(cache, comp, want, mamba_want, kv, states) -> (Full units, states): "
     "fast/one_aux.py _evict_mamba's loops, the frees appended to kv and states; None: "
     "declined, nothing changed"},
    {"pair_evict", (PyCFunction)(void (*)(void))core_pair_evict, METH_FASTCALL,
     "pair_evict(cache, swa, mamba, want, swa_want, mamba_want, runs, states) -> (Full units, "
     "SWA units, states): fast/pair_evict.py evict_pair's loops, the frees added to runs and "
     "states; None: declined, nothing changed"},
    {"one_insert", (PyCFunction)(void (*)(void))core_one_insert, METH_FASTCALL,
     "one_insert(cache, comp, swa, plan, value, units, extra_key, prev, e, n, total, prepared, "
     "direct, page_size) -> InsertResult: fast/one_aux.py insert_one's walk, leaf and commit; "
     "None where the Python loop must run (nothing changed)"},
    {"state_copy", (PyCFunction)(void (*)(void))core_state_copy, METH_FASTCALL,
     "state_copy(state) -> a one-slot int64 tensor of its own with state's value (from a "
     "slab of views), or None where state is not a plain one-slot CPU int64 tensor"},
    {"pair_insert", (PyCFunction)(void (*)(void))core_pair_insert, METH_FASTCALL,
     "pair_insert(cache, swa, mamba, plan, value, units, extra_key, prev, e, n, total, state, "
     "page_size) -> InsertResult: fast/hybrid.py _insert's walk, leaf and commits for the "
     "stock SWA and Mamba plug-ins together; None where the general path must run (nothing "
     "changed)"},
    {"pair_insert_api", (PyCFunction)(void (*)(void))core_pair_insert_api, METH_FASTCALL,
     "pair_insert_api(cache, params) -> fast/hybrid.py _insert's InsertResult for the stock "
     "SWA and Mamba plug-ins together, checks to commits; None where the Python function "
     "must run (nothing changed)"},
    {"one_plan", (PyCFunction)(void (*)(void))core_one_plan, METH_FASTCALL,
     "one_plan(root, units, extra_key, page_size, step) -> [(node, shared units)]: "
     "fast/cache.py _plan's walk from root"},
    {"host_match", (PyCFunction)(void (*)(void))core_host_match, METH_FASTCALL,
     "host_match(cache, units, extra_key, n[, comp, is_swa, window]) -> fast/host_full.py "
     "match_host's MatchResult after its key (with the component: fast/host_aux.py "
     "match_host_aux's), or None (nothing changed) where the Python function must run"},
    {"host_inc", (PyCFunction)(void (*)(void))core_host_inc, METH_FASTCALL,
     "host_inc(cache, node) -> fast/host_full.py inc_lock_host's result, or None"},
    {"host_dec", (PyCFunction)(void (*)(void))core_host_dec, METH_FASTCALL,
     "host_dec(cache, node, params) -> fast/host_full.py dec_lock_host's result, or None"},
    {"host_unlock", (PyCFunction)(void (*)(void))core_host_unlock, METH_FASTCALL,
     "host_unlock(cache, anchor) -> HostTier._full_write_unlock(anchor)'s units, or None"},
    {"host_writing", (PyCFunction)(void (*)(void))core_host_writing, METH_FASTCALL,
     "host_writing(tier) -> True where HostTier.writing_check() ran whole in C, else None"},
    {"host_setup", (PyCFunction)(void (*)(void))core_host_setup, METH_FASTCALL,
     "host_setup(HostTier, LazyHeap, HostIncLockRefResult, DecLockRefResult, "
     "HostDecLockRefParams, _Event, Ack, InFlight): what the host twins check and build"},
    {"host_insert_setup", (PyCFunction)(void (*)(void))core_host_insert_setup, METH_FASTCALL,
     "host_insert_setup(HostTier, _write_backup_full, _full_write_lock, _Event, Ack, InFlight, "
     "HostDecLockRefParams): what host_insert's written-out backup stands for"},
    {"host_insert", (PyCFunction)(void (*)(void))core_host_insert, METH_FASTCALL,
     "host_insert(cache, plan, value, units, extra_key, prev, chunked, n, total, page_size, "
     "deferred, owned) -> InsertResult: fast/host_full.py insert_host from the root's stamp on; "
     "None where the Python loop must run (nothing changed)"},
    {"host_evict_setup", (PyCFunction)(void (*)(void))core_host_evict_setup, METH_FASTCALL,
     "host_evict_setup(HostTier.evict_leaf, FreeBatch): what host_evict stands for and builds"},
    {"host_evict", (PyCFunction)(void (*)(void))core_host_evict, METH_FASTCALL,
     "host_evict(cache, want) -> [Full units]: fast/hybrid.py _evict_units(want) for the Full "
     "component alone over the host tier, its loop, release and compaction; None where the "
     "Python loop must run (nothing changed)"},
    {"host_take_setup", (PyCFunction)(void (*)(void))core_host_take_setup, METH_FASTCALL,
     "host_take_setup(native_alloc_ok): the host pool classes host_take writes out"},
    {"host_take", (PyCFunction)(void (*)(void))core_host_take, METH_FASTCALL,
     "host_take(pool, n) -> a new int64 tensor of the slots pool.alloc(n) hands out, the "
     "pool's list left as it leaves it; None where the pool is short; NotImplemented where "
     "declined (nothing done: call pool.alloc)"},
    {"one_insert_api", (PyCFunction)(void (*)(void))core_one_insert_api, METH_FASTCALL,
     "one_insert_api(cache, params) -> fast/one_aux.py insert_one's InsertResult for one stock "
     "SWA or Mamba plug-in, checks to commit; None where the Python function must run "
     "(nothing changed)"},
    {"host_aux_insert", (PyCFunction)(void (*)(void))core_host_aux_insert, METH_FASTCALL,
     "host_aux_insert(cache, comp, swa, plan, value, units, extra_key, prev, chunked, e, n, "
     "total, page_size, deferred, prepared) -> fast/hybrid.py _insert's InsertResult from the "
     "root's stamp on for one stock SWA or Mamba plug-in over the host tier; None where the "
     "Python loop must run (nothing changed)"},
    {"host_aux_evict_setup", (PyCFunction)(void (*)(void))core_host_aux_evict_setup,
     METH_FASTCALL, "host_aux_evict_setup(SwaComponent, MambaComponent): the component "
     "classes host_aux_evict writes out"},
    {"host_aux_evict", (PyCFunction)(void (*)(void))core_host_aux_evict, METH_FASTCALL,
     "host_aux_evict(cache, want, aux_want) -> [Full units, the component's units]: "
     "fast/hybrid.py _evict_units(want, wants) for one stock SWA or Mamba plug-in over the "
     "host tier, its loops, release and compaction; None where the Python path must run "
     "(nothing changed)"},
    {NULL, NULL, 0, NULL}
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "uniradix.fast._core",
    "The hot loops of uniradix.fast.UnifiedRadixCache in C (see fast/_core.c).", -1, core_methods,
};

PyMODINIT_FUNC
PyInit__core(void)
{
    if (PyType_Ready(&SlotsType) < 0)
        return NULL;
    if (PyType_Ready(&TailMemType) < 0)
        return NULL;
    if (PyType_Ready(&NodeType) < 0)
        return NULL;
#define INTERN(var, s) if ((var = PyUnicode_InternFromString(s)) == NULL) return NULL
    INTERN(s_root_node, "root_node");
    INTERN(s_page_size, "page_size");
    INTERN(s_clock, "_clock");
    INTERN(s_heap, "_heap");
    INTERN(s_evictable, "_evictable");
    INTERN(s_protected, "_protected");
    INTERN(s_alloc, "token_to_kv_pool_allocator");
    INTERN(s_free, "free");
    INTERN(s_owned, "_owned");
    INTERN(s_validate, "validate_slots");
    INTERN(s_tolist, "tolist");
    INTERN(s_update, "update");
    INTERN(s_difference_update, "difference_update");
    INTERN(s_key, "key");
    INTERN(s_value, "value");
    INTERN(s_prev, "prev_prefix_len");
    INTERN(s_chunked, "chunked");
    INTERN(s_token_ids, "token_ids");
    INTERN(s_extra_key, "extra_key");
    INTERN(s_is_bigram, "is_bigram");
    INTERN(s_is_eagle, "is_eagle");
    INTERN(s_disable, "disable");
    INTERN(s_validate_slots, "validate_slots");
    INTERN(s_empty, "_empty");
    INTERN(s_dtype, "dtype");
    INTERN(s_shape, "shape");
    INTERN(s_num_tokens, "num_tokens");
    INTERN(s_skip, "skip_lock_node_ids");
    INTERN(s_compact, "_compact_heap");
    INTERN(s_uk_leaf_heap, "_leaf_heap");
    INTERN(s_uk_cap, "cap");
    INTERN(s_free_values, "_free_values");
    INTERN(s_free_joined, "_free_joined");
    INTERN(s_free_order, "uniradix_free_order");
    INTERN(s_queue, "queue");
    INTERN(s_free_ranges, "_free_ranges");
    INTERN(s_numel, "numel");
    INTERN(s_data_ptr, "data_ptr");
    INTERN(s_is_cpu, "is_cpu");
    INTERN(s_ndim, "ndim");
    INTERN(s_is_contiguous, "is_contiguous");
    INTERN(s_free_pages, "free_pages");
    INTERN(s_release_pages, "release_pages");
    INTERN(s_need_sort, "need_sort");
    INTERN(s_in_group, "is_not_in_free_group");
    INTERN(s_debug_mode, "debug_mode");
    INTERN(s_on_batch, "uniradix_on_batch");
    INTERN(s_narrow, "narrow");
    INTERN(s_tail, "_free_tail");
    INTERN(s_free_head, "_free_head");
    INTERN(s_untyped_storage, "untyped_storage");
    INTERN(s_cdata, "_cdata");
    INTERN(s_tail_hw, "_free_tail_hw");
    INTERN(s_page_size_attr, "page_size");
    INTERN(s_free_slots, "free_slots");
    INTERN(s_lock, "lock");
    INTERN(s_acquire, "acquire");
    INTERN(s_release, "release");
    INTERN(s_tail_at, "_free_tail_at");
    INTERN(s_full_attn, "full_attn_allocator");
    INTERN(s_swa_attn, "swa_attn_allocator");
    INTERN(s_mapping, "full_to_swa_index_mapping");
    INTERN(s_free_swa, "free_swa");
    INTERN(s_available_size, "available_size");
    INTERN(s_size_attr, "size");
    INTERN(s_split, "split");
    INTERN(s_module_attr, "__module__");
    INTERN(s_qualname, "__qualname__");
    INTERN(s_children, "children");  /* (Python-node fields) */
    INTERN(s_parent, "parent");
    INTERN(s_lock_ref, "lock_ref");
    INTERN(s_aux_lock, "aux_lock");
    INTERN(s_dev_children, "dev_children");
    INTERN(s_last_access_time, "last_access_time");
    INTERN(s_aux, "aux");
    INTERN(s_lru_prev, "lru_prev");
    INTERN(s_lru_next, "lru_next");
    INTERN(s_lru, "lru");
    INTERN(s_head, "head");
    INTERN(s_events, "_events");
    INTERN(s_split_m, "_split");
    INTERN(s_comp_evictable, "evictable");
    INTERN(s_comp_protected, "protected");
    INTERN(s_ck_one_aux, "_one_aux");  /* (composed tree: clock) */
    INTERN(s_ck_window, "window");
    INTERN(s_ck_i, "i");
    INTERN(s_ck_next_boundary, "_next_boundary");
    INTERN(s_ck_split_epoch, "_split_epoch");
    INTERN(s_ck_swa_uuid, "swa_uuid_for_lock");
    INTERN(s_cm_chunk, "mamba_cache_chunk_size");
    INTERN(s_cm_components, "components");
    INTERN(s_cm_window, "_inline_window");
    INTERN(s_cm_pair, "_pair");
    INTERN(s_cm_cow, "cow_mamba");
    INTERN(s_ce_tail, "tail");
    INTERN(s_ce_removed, "removed");
    INTERN(s_ci_deferred, "_deferred");
    INTERN(s_ci_i, "i");
    INTERN(s_ci_overlap, "overlap");
    INTERN(s_ci_free_m, "_free");
    INTERN(s_ci_translate, "translate");
    INTERN(s_ci_stamp_m, "_stamp");
    INTERN(s_ci_tracks, "tracks_slots");
    INTERN(s_ci_on_set, "on_set");
    INTERN(s_ci_map_pool, "map_pool");
    INTERN(s_ci_swa_leaf, "swa_leaf");
    INTERN(s_ci_stored, "stored");
    INTERN(s_pi_seqlen, "swa_evicted_seqlen");
    INTERN(s_pi_mamba_value, "mamba_value");
    INTERN(s_pi_priority, "priority");
    INTERN(s_pi_storage, "storage_tier");
    INTERN(s_pi_tier, "tier");
    INTERN(s_pi_policy, "_policy_key");
    INTERN(s_pi_pair_insert, "_pair_insert");
    INTERN(s_pi_swa, "swa");
    INTERN(s_pi_mamba, "mamba");
    INTERN(s_pi_step, "match_step");
    INTERN(s_pi_clone, "clone");
    INTERN(s_oi_flag, "_one_insert");
#undef INTERN
    if ((s_zero = PyLong_FromLong(0)) == NULL)
        return NULL;
#ifdef HAVE_PROBE
    if (PyType_Ready(&ProbeType) < 0)
        return NULL;
    if (g_probe == NULL) {
        int same = probe_self_test();
        if (same < 0)
            return NULL;
        if (same) {
            g_probe = PyObject_New(Probe, &ProbeType);
            if (g_probe == NULL)
                return NULL;
            g_probe->p = NULL;
            g_probe->ps = 0;
            g_probe->ek = NULL;
        }
    }
#endif
    PyObject *m = PyModule_Create(&core_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&NodeType);
    if (PyModule_AddObject(m, "TreeNode", (PyObject *)&NodeType) < 0) {
        Py_DECREF(&NodeType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}


/* ------------------------------------------------------------------------------------------ */
/* One step of the Python-side walks (fast/keys.py match_step_py, which is the definition)    */
/* ------------------------------------------------------------------------------------------ */
/*
 * The composed tree's walks (fast/hybrid.py, fast/one_aux.py) and the Full cache's Python
 * walks (fast/cache.py) take one step per node: the child holding the page at pos, and how far
 * the walk goes into it.  For array('q') units and keys this does it without slicing: the
 * child key is built once for the dict lookup and the key is compared in place.  Anything
 * else (EAGLE's bigram lists, a key that is not an int64 buffer) goes to the Python
 * definition, so the two give the same answers (tests/fast/test_match_step.py).
 */

static PyObject *g_step_fallback = NULL;  /* keys.match_step_py */
static PyObject *g_no_step = NULL;        /* keys.NO_STEP */

static PyObject *
core_match_step_setup(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyCallable_Check(args[0]) || !PyTuple_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "match_step_setup(fallback, no_step: tuple)");
        return NULL;
    }
    Py_XSETREF(g_step_fallback, Py_NewRef(args[0]));
    Py_XSETREF(g_no_step, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

static PyObject *
core_match_step(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC(6, "match_step(children, units, pos, n, page_size, extra_key)");
    if (g_step_fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "match_step: match_step_setup was not called");
        return NULL;
    }
    PyObject *children = args[0], *units = args[1], *ek = args[5];
    if (!PyDict_CheckExact(children) || !PyLong_CheckExact(args[2]) || !PyLong_CheckExact(args[3])
            || !PyLong_CheckExact(args[4]) || !PyObject_CheckBuffer(units))
        return PyObject_Vectorcall(g_step_fallback, args, (size_t)nargs, NULL);
    Py_ssize_t pos = PyLong_AsSsize_t(args[2]), n = PyLong_AsSsize_t(args[3]);
    Py_ssize_t ps = PyLong_AsSsize_t(args[4]);
    if ((pos == -1 || n == -1 || ps == -1) && PyErr_Occurred())
        return NULL;
    KeyView uk, kv;
    if (key_view(units, &uk) < 0) {
        PyErr_Clear();
        return PyObject_Vectorcall(g_step_fallback, args, (size_t)nargs, NULL);
    }
    if (pos < 0 || ps < 1 || n > uk.n || pos + ps > n) {  /* not a whole page at pos */
        key_release(&uk);
        return PyObject_Vectorcall(g_step_fallback, args, (size_t)nargs, NULL);
    }
    PyObject *ck = child_key(uk.p, pos, ps, ek);
    if (ck == NULL) {
        key_release(&uk);
        return NULL;
    }
    PyObject *child = PyDict_GetItemWithError(children, ck);  /* borrowed */
    Py_DECREF(ck);
    if (child == NULL) {
        key_release(&uk);
        return PyErr_Occurred() ? NULL : Py_NewRef(g_no_step);
    }
    Py_INCREF(child);  /* the lookup's reference is borrowed from a dict that may change */
    PyObject *ckey = PyObject_GetAttr(child, s_key);
    if (ckey == NULL || key_view(ckey, &kv) < 0) {
        Py_XDECREF(ckey);
        Py_DECREF(child);
        key_release(&uk);
        PyErr_Clear();  /* (no key attribute: the definition raises it again) */
        return PyObject_Vectorcall(g_step_fallback, args, (size_t)nargs, NULL);
    }
    Py_ssize_t k = kv.n;
    int split = !(pos + k <= n && memcmp(uk.p + pos, kv.p, (size_t)k * sizeof(long long)) == 0);
    if (split)
        k = shared_pages(kv.p, kv.n, uk.p + pos, n - pos, ps);
    key_release(&kv);
    Py_DECREF(ckey);
    key_release(&uk);
    PyObject *kk = PyLong_FromSsize_t(k);
    PyObject *r = kk == NULL ? NULL : PyTuple_Pack(3, child, kk, split ? Py_True : Py_False);
    Py_XDECREF(kk);
    Py_DECREF(child);
    return r;
}
