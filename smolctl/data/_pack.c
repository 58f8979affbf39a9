/* The per-document loops of `smolctl pack`'s best-fit-decreasing packing, in C.

   smolctl/data/pack_rows.py defines what is computed (its pure-Python/numpy functions are the reference and the
   fallback where this extension was not built); these functions only fill arrays the caller allocates (plain
   buffers, no numpy C API). They run each time a packing buffer fills, and once more for the last, partly full
   buffer of a unit after its last batch is tokenised: that run is the tail of a pack.

   best_fit_decreasing(lengths, order, capacity, bin_of, offset) -> bins
       Items (int64 lengths, each 0..capacity) placed in the sequence `order` (int64, a permutation: longest
       first) into the open bin with the least room that fits, or into a new bin; open bins with equal room are a
       stack (the last one to reach that room is used first). Outputs: bin_of and offset (int64) of each item.
       Exactly pack_rows.best_fit_decreasing_python.
   join_encodings(encodings, eos_id, ids)
       encodings is a list of the tokenizer's Encodings (any objects whose `ids` attribute is a list of ints:
       each document's token ids); the non-empty ones are written to ids (int32) back to back, each followed by
       eos_id, so ids must hold exactly their tokens plus one per non-empty document. Exactly
       pack_tokens.join_documents_python of their id lists.
   place(ids, lengths, slots, input_ids, position_ids)
       Document i is the next lengths[i] tokens of ids (int32, documents back to back); it is copied to
       input_ids[slots[i] ...] and position_ids there get 0, 1, ..., lengths[i] - 1 (both int32, flat).
*/
#include "_buffers.h" /* first: it includes Python.h, which must precede the standard headers */

#include <stdint.h>
#include <stdlib.h>

/* Open bins by free room: bins_at[r] is the top of the stack of bins with exactly r free slots (-1: none),
   below[bin] the next one down; bit r of `rooms` is set when that stack is not empty, so the best fit for
   an item of length n is the lowest set bit at or above n, a scan of at most capacity / 64 words. */
static Py_ssize_t pack_bins(const int64_t *lengths, const int64_t *order, Py_ssize_t n, int64_t capacity,
                            int64_t *bin_of, int64_t *offset, int64_t *bins_at, int64_t *below, int64_t *used,
                            uint64_t *rooms) {
    Py_ssize_t words = (Py_ssize_t)(capacity >> 6) + 1, bins = 0;
    for (int64_t r = 0; r <= capacity; r++) bins_at[r] = -1;
    memset(rooms, 0, sizeof(uint64_t) * words);
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t item = order[k], need = lengths[item], room = -1, target;
        Py_ssize_t w = (Py_ssize_t)(need >> 6);
        uint64_t bits = rooms[w] & (~0ULL << (need & 63));
        while (!bits && ++w < words) bits = rooms[w];
        if (bits) {
            room = (int64_t)w * 64 + __builtin_ctzll(bits);
            target = bins_at[room];
            bins_at[room] = below[target];
            if (bins_at[room] < 0) rooms[room >> 6] &= ~(1ULL << (room & 63));
        } else {
            target = bins++;
            room = capacity;
            used[target] = 0;
        }
        bin_of[item] = target;
        offset[item] = used[target];
        used[target] += need;
        int64_t left = room - need;
        if (left) {
            below[target] = bins_at[left];
            bins_at[left] = target;
            rooms[left >> 6] |= 1ULL << (left & 63);
        }
    }
    return bins;
}

static PyObject *best_fit_decreasing(PyObject *self, PyObject *args) {
    PyObject *objects[4];
    long long capacity;
    if (!PyArg_ParseTuple(args, "OOLOO", &objects[0], &objects[1], &capacity, &objects[2], &objects[3])) return NULL;
    const char *names[] = {"lengths", "order", "bin_of", "offset"};
    const Py_ssize_t sizes[] = {8, 8, 8, 8};
    Buffer b[4];
    if (get_buffers(objects, b, 4, names, sizes, 2) < 0) return NULL;
    Py_ssize_t n = b[0].view.len / 8;
    const int64_t *lengths = b[0].view.buf, *order = b[1].view.buf;
    /* A row longer than 2^31 tokens is no sequence length; the bound also keeps the allocations below exact. */
    if (capacity < 1 || capacity > INT32_MAX) return refuse(b, 4, "capacity must be 1..2^31-1");
    if (b[1].view.len / 8 != n || b[2].view.len / 8 != n || b[3].view.len / 8 != n)
        return refuse(b, 4, "lengths, order, bin_of and offset must have the same length");
    for (Py_ssize_t i = 0; i < n; i++)
        if (lengths[i] < 0 || lengths[i] > capacity) return refuse(b, 4, "every length must be 0..capacity");
    /* order must be a permutation: each item placed exactly once. */
    char *seen = calloc(n ? n : 1, 1);
    int64_t *bins_at = malloc(sizeof(int64_t) * (capacity + 1));
    int64_t *below = malloc(sizeof(int64_t) * (n ? n : 1));
    int64_t *used = malloc(sizeof(int64_t) * (n ? n : 1));
    uint64_t *rooms = malloc(sizeof(uint64_t) * ((capacity >> 6) + 1));
    PyObject *result = NULL;
    if (!seen || !bins_at || !below || !used || !rooms) {
        release(b, 4);
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (order[k] < 0 || order[k] >= n || seen[order[k]]) {
            result = refuse(b, 4, "order must be a permutation of 0..len(lengths) - 1");
            goto done;
        }
        seen[order[k]] = 1;
    }
    Py_ssize_t bins;
    Py_BEGIN_ALLOW_THREADS
    bins = pack_bins(lengths, order, n, capacity, b[2].view.buf, b[3].view.buf, bins_at, below, used, rooms);
    Py_END_ALLOW_THREADS
    release(b, 4);
    result = PyLong_FromSsize_t(bins);
done:
    free(seen);
    free(bins_at);
    free(below);
    free(used);
    free(rooms);
    return result;
}

/* Token ids arrive as one Python list of ints per document (Encoding.ids: the tokenizers API has no array
   output); one C pass replaces a numpy.fromiter over a chain of lists and the EOS insertion after it. Each
   document's list is asked for, copied and dropped in turn, so only one document's ints are alive at a time:
   the interpreter's small-object pools are reused document after document instead of a batch's worth of fresh
   pages being touched (and returned to the kernel) every batch. Holds the GIL throughout: it reads Python
   objects. Lists read with the stable ABI's PyList_GetItem (no direct item access there). */
static PyObject *join_encodings(PyObject *self, PyObject *args) {
    PyObject *encodings, *out;
    long long eos_id;
    if (!PyArg_ParseTuple(args, "O!LO", &PyList_Type, &encodings, &eos_id, &out)) return NULL;
    if (eos_id < 0 || eos_id > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "eos_id must be 0..2^31-1");
        return NULL;
    }
    const char *names[] = {"ids"};
    const Py_ssize_t sizes[] = {4};
    Buffer b[1];
    if (get_buffers(&out, b, 1, names, sizes, 0) < 0) return NULL;
    const char *wrong_size = "ids must hold exactly the tokens plus one EOS per non-empty document";
    const char *problem = NULL;
    int32_t *ids = b[0].view.buf;
    Py_ssize_t room = b[0].view.len / 4, written = 0, n = PyList_Size(encodings);
    for (Py_ssize_t i = 0; i < n && !problem; i++) {
        /* A new reference: the list stays alive while it is read, whatever the attribute's getter does. */
        PyObject *document = PyObject_GetAttrString(PyList_GetItem(encodings, i), "ids");
        if (document == NULL) {
            release(b, 1);
            return NULL;
        }
        if (!PyList_Check(document)) problem = "each encoding's ids must be a list of token ids";
        Py_ssize_t length = problem ? 0 : PyList_Size(document);
        if (length && written + length + 1 > room) problem = wrong_size;
        for (Py_ssize_t k = 0; k < length && !problem; k++) {
            PyObject *item = PyList_GetItem(document, k);
            /* ints only: anything else would run its __index__, Python code that could change the list read here */
            if (!PyLong_Check(item)) {
                problem = "token ids must be ints";
                break;
            }
            long value = PyLong_AsLong(item);
            if (value < 0 || value > INT32_MAX) {
                if (PyErr_Occurred()) PyErr_Clear(); /* past a C long: out of range all the same */
                problem = "token ids must be 0..2^31-1";
                break;
            }
            ids[written++] = (int32_t)value;
        }
        if (length && !problem) ids[written++] = (int32_t)eos_id;
        Py_DECREF(document);
    }
    if (!problem && written != room) problem = wrong_size;
    if (problem) return refuse(b, 1, problem);
    release(b, 1);
    Py_RETURN_NONE;
}

static PyObject *place(PyObject *self, PyObject *args) {
    PyObject *objects[5];
    if (!PyArg_ParseTuple(args, "OOOOO", &objects[0], &objects[1], &objects[2], &objects[3], &objects[4])) return NULL;
    const char *names[] = {"ids", "lengths", "slots", "input_ids", "position_ids"};
    const Py_ssize_t sizes[] = {4, 8, 8, 4, 4};
    Buffer b[5];
    if (get_buffers(objects, b, 5, names, sizes, 3) < 0) return NULL;
    Py_ssize_t tokens = b[0].view.len / 4, n = b[1].view.len / 8, out = b[3].view.len / 4;
    const int32_t *ids = b[0].view.buf;
    const int64_t *lengths = b[1].view.buf, *slots = b[2].view.buf;
    int32_t *input_ids = b[3].view.buf, *position_ids = b[4].view.buf;
    if (b[2].view.len / 8 != n) return refuse(b, 5, "lengths and slots must have the same length");
    if (b[4].view.len / 4 != out) return refuse(b, 5, "input_ids and position_ids must have the same size");
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (lengths[i] < 0 || slots[i] < 0 || slots[i] > out - lengths[i])
            return refuse(b, 5, "every document must lie inside input_ids");
        total += lengths[i];
    }
    if (total != tokens) return refuse(b, 5, "the lengths must add up to len(ids)");
    Py_BEGIN_ALLOW_THREADS
    const int32_t *source = ids;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t length = lengths[i];
        memcpy(input_ids + slots[i], source, sizeof(int32_t) * (size_t)length);
        int32_t *positions = position_ids + slots[i];
        for (int64_t k = 0; k < length; k++) positions[k] = (int32_t)k;
        source += length;
    }
    Py_END_ALLOW_THREADS
    release(b, 5);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"best_fit_decreasing", best_fit_decreasing, METH_VARARGS, "Best-fit-decreasing bins and offsets (see the file's header)."},
    {"join_encodings", join_encodings, METH_VARARGS, "Encodings' token ids to one int32 array, EOS after each non-empty one (see the file's header)."},
    {"place", place, METH_VARARGS, "Copy documents to their slots with their positions (see the file's header)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pack", "Packing kernels; see smolctl/data/pack_rows.py.", -1, methods};

PyMODINIT_FUNC PyInit__pack(void) { return PyModule_Create(&module); }
