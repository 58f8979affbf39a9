/* The loops of MinHash dedup that touch every byte, token, shingle x permutation or set member, in C.

   smolctl/data/minhash/kernels.py defines what is computed and does everything else in numpy; these functions only
   fill arrays the caller allocates (no numpy C API: plain buffers), so that a batch of documents is hashed
   in one pass over its bytes instead of a dozen whole-array numpy passes and their temporaries.

   tokenize(data, extra, starts, ends, exact, word_hashes, word_counts) -> words
       Document i is the UTF-8 bytes [starts[i], ends[i]) of data, or of extra when starts[i] >= len(data)
       (counted from len(data)): a batch's arrow buffer with the documents that needed normalising in Python
       placed in a second buffer. A token is a maximal run of non-whitespace bytes, a word the token without
       its leading and trailing ASCII punctuation (none if nothing is left); both are hashed with ASCII letters
       lower-cased (see hash_span). Outputs: exact, uint64[n, 2], a 128-bit hash of each document's token
       sequence (see tokenize_document); the word hashes end to end, and the words of each document.
   shingles(tokens, offsets, weights, out, out_counts) -> total
       The n-grams of consecutive tokens of each document, as mix64(sum_k tokens[j + k] * weights[k]); a
       document with 1 to n - 1 tokens has one, of all its tokens. out: uint64 end to end, out_counts per document.
   intersections(values, bounds, left, right, out)
       out[k] = |set left[k] & set right[k]|, set i being the sorted unique values[bounds[i]:bounds[i + 1]].
   agreements(signatures, perms, left, right, out)
       out[k] = how many of the perms values of rows left[k] and right[k] of signatures (uint32[n, perms]) agree.
   signatures(shingles, offsets, multipliers, out)
       out[i, p] = min over the shingles s of document i of (uint32)(multipliers[p] * (uint32)(s >> 32)),
       0xFFFFFFFF for a document without shingles. out: uint32[n, len(multipliers)], C order.
   changing_documents(data, starts, ends, table, out)
       out[i] = 1 if the UTF-8 bytes [starts[i], ends[i]) of data hold a character whose bit is set in table
       (one bit per code point below 8 * len(table), little-endian within each byte) or a character at or above
       8 * len(table); else 0. A byte that does not begin a well-formed sequence is skipped on its own.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { SPACE = 0, WORD = 1, PUNCT = 2 };
#define RADIX 0x100000001B3ULL

static uint8_t byte_class[256];

/* splitmix64's finaliser (minhash.mix64). */
static inline uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* RADIX^8: the step between the multipliers of consecutive 8-byte chunks of a span. */
static uint64_t radix_8;

static void init_tables(void) {
    for (int c = 0; c < 256; c++) {
        int word = c >= 128 || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
        byte_class[c] = word ? WORD : PUNCT;
    }
    /* The ASCII characters str.split() splits on. */
    const char *spaces = "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f ";
    for (const char *s = spaces; *s; s++) byte_class[(uint8_t)*s] = SPACE;
    radix_8 = 1;
    for (int k = 0; k < 8; k++) radix_8 *= RADIX;
}

/* A span's hash: its bytes (ASCII letters lower-cased) as 8-byte little-endian chunks c_m, the last one
   zero-padded, summed as sum_m c_m * RADIX^(8m + 1) (mod 2^64; odd multipliers, so a single differing chunk
   always changes the sum), then finished with the span's length and a multiply-xorshift. One multiply per
   8 bytes. */
static inline uint64_t finish_hash(uint64_t sum, Py_ssize_t length) {
    uint64_t mixed = (sum + (uint64_t)length * 0x9E3779B97F4A7C15ULL) * 0xBF58476D1CE4E5B9ULL;
    return (mixed ^ (mixed >> 31)) | 1ULL;
}

static inline uint64_t little_endian(uint64_t x) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return __builtin_bswap64(x);
#else
    return x;
#endif
}

typedef struct {
    Py_buffer view;
    int held;
} Buffer;

static void release(Buffer *buffers, int count) {
    for (int i = 0; i < count; i++)
        if (buffers[i].held) PyBuffer_Release(&buffers[i].view);
}

/* The buffers of objects[0..count): C-contiguous, of items of sizes[i] bytes, writable from first_output on.
   On failure the ones taken are released and the Python error is set. */
static int get_buffers(PyObject **objects, Buffer *b, int count, const char **names, const Py_ssize_t *sizes,
                       int first_output) {
    memset(b, 0, sizeof(Buffer) * count);
    for (int i = 0; i < count; i++) {
        int flags = PyBUF_C_CONTIGUOUS | (i >= first_output ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(objects[i], &b[i].view, flags) < 0) {
            release(b, count);
            return -1;
        }
        b[i].held = 1;
        if (b[i].view.len % sizes[i] != 0) {
            PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of %zd-byte items", names[i], b[i].view.len, sizes[i]);
            release(b, count);
            return -1;
        }
    }
    return 0;
}

/* Release the buffers and raise ValueError(message): for arguments that do not fit together. */
static PyObject *refuse(Buffer *b, int count, const char *message) {
    release(b, count);
    PyErr_SetString(PyExc_ValueError, message);
    return NULL;
}

/* docs + 1 offsets into `items` values: ascending, and inside. */
static int check_offsets(const int64_t *offsets, Py_ssize_t docs, Py_ssize_t items) {
    for (Py_ssize_t i = 0; i < docs; i++)
        if (offsets[i] < 0 || offsets[i] > offsets[i + 1] || offsets[i + 1] > items) return 0;
    return docs >= 0;
}

/* Every pair (left[k], right[k]) names one of `count` rows. */
static int pairs_inside(const int64_t *left, const int64_t *right, Py_ssize_t pairs, Py_ssize_t count) {
    for (Py_ssize_t k = 0; k < pairs; k++)
        if (left[k] < 0 || left[k] >= count || right[k] < 0 || right[k] >= count) return 0;
    return 1;
}

/* Eight bytes at a time ("SWAR"): the byte classes of a 64-bit load as masks with the high bit of each
   byte set, so that a token's end is a count of trailing zeros instead of a mispredicted branch per token. */
#define ONES 0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL
#define LOW7 0x7F7F7F7F7F7F7F7FULL

/* High bit of each byte b of x with low < b < high (the "hasbetween" bit hack; exact for every byte). */
static inline uint64_t bytes_between(uint64_t x, unsigned low, unsigned high) {
    uint64_t low7 = x & LOW7;
    return (ONES * (127 + high) - low7) & ~x & (low7 + ONES * (127 - low)) & HIGHS;
}

static inline uint64_t space_bytes(uint64_t x) {
    return bytes_between(x, 8, 14) | bytes_between(x, 27, 33);  /* \t \n \v \f \r, \x1c-\x1f and ' ' */
}

static inline uint64_t word_bytes(uint64_t x) {
    return (x & HIGHS) | bytes_between(x, 47, 58) | bytes_between(x, 64, 91) | bytes_between(x, 96, 123)
           | bytes_between(x, 94, 96);  /* non-ASCII, 0-9, A-Z, a-z, _ */
}

/* The 8 bytes at p, the ones at or past `end` reading as spaces (and never read past the buffer). */
static inline uint64_t load_chunk(const uint8_t *p, const uint8_t *end) {
    uint64_t x;
    if (end - p >= 8) {
        memcpy(&x, p, 8);
        return little_endian(x);
    }
    x = ONES * ' ';
    memcpy(&x, p, (size_t)(end - p));
    return little_endian(x);
}

static inline uint64_t lower_ascii(uint64_t x) {
    return x | (bytes_between(x, 64, 91) >> 2);  /* A-Z to a-z: 0x20 added to those bytes */
}

/* finish_hash of any span (the tokeniser's slow path: words trimmed of punctuation). */
static uint64_t hash_span(const uint8_t *bytes, Py_ssize_t length) {
    uint64_t sum = 0, multiplier = RADIX;
    for (Py_ssize_t k = 0; k < length; k += 8) {
        uint64_t x = 0;
        memcpy(&x, bytes + k, length - k < 8 ? (size_t)(length - k) : 8);
        sum += lower_ascii(little_endian(x)) * multiplier;
        multiplier *= radix_8;
    }
    return finish_hash(sum, length);
}

static const uint64_t EXACT_RADIX[2] = {0x9E3779B97F4A7C15ULL, 0xD6E8FEB86659FD93ULL};

/* Words and the exact hash of one document (bytes [start, end)); returns 0 if the word room ran out.
   The exact hash is two polynomials sum_i t_i * R^i of the token hashes t_i, finished with the token count:
   token hashes are folded in as they are found and never stored. */
static int tokenize_document(const uint8_t *start, const uint8_t *end, uint64_t *exact, uint64_t *word_hashes,
                             Py_ssize_t *words, Py_ssize_t word_room) {
    const uint8_t *p = start;
    uint64_t exact_sum[2] = {0, 0}, exact_power[2] = {1, 1}, tokens = 0;
    while (p < end) {
        uint64_t x = load_chunk(p, end), spaces = space_bytes(x);
        if (spaces == HIGHS) { p += 8; continue; }
        p += __builtin_ctzll(~spaces & HIGHS) / 8;  /* the token's first byte */
        if (*words >= word_room) return 0;
        const uint8_t *token = p;
        uint64_t sum = 0, multiplier = RADIX, punctuation = 0;
        Py_ssize_t length = 0;
        for (;;) {
            x = load_chunk(p, end);
            spaces = space_bytes(x);
            unsigned inside = spaces ? __builtin_ctzll(spaces) / 8 : 8;  /* token bytes in this chunk */
            uint64_t keep = inside == 8 ? ~0ULL : (1ULL << (8 * inside)) - 1;
            x &= keep;
            punctuation |= ~word_bytes(x) & keep & HIGHS;
            sum += lower_ascii(x) * multiplier;
            multiplier *= radix_8;
            length += inside;
            p += inside;
            if (inside < 8) break;
        }
        uint64_t hash = finish_hash(sum, length);
        for (int column = 0; column < 2; column++) {
            exact_sum[column] += hash * exact_power[column];
            exact_power[column] *= EXACT_RADIX[column];
        }
        tokens++;
        if (!punctuation) {
            word_hashes[(*words)++] = hash;
            continue;
        }
        /* Rarer: a token with punctuation, trimmed to its first and last word bytes (if any). */
        Py_ssize_t first = 0, last = length - 1;
        while (first < length && byte_class[token[first]] != WORD) first++;
        while (last > first && byte_class[token[last]] != WORD) last--;
        if (first < length)
            word_hashes[(*words)++] = (first == 0 && last == length - 1) ? hash : hash_span(token + first, last + 1 - first);
    }
    for (int column = 0; column < 2; column++) exact[column] = mix64(exact_sum[column] ^ tokens * EXACT_RADIX[column]);
    return 1;
}

static PyObject *tokenize(PyObject *self, PyObject *args) {
    PyObject *objects[7];
    if (!PyArg_ParseTuple(args, "OOOOOOO", &objects[0], &objects[1], &objects[2], &objects[3], &objects[4], &objects[5],
                          &objects[6]))
        return NULL;
    Buffer b[7];
    static const char *names[7] = {"data", "extra", "starts", "ends", "exact", "word_hashes", "word_counts"};
    static const Py_ssize_t sizes[7] = {1, 1, 8, 8, 16, 8, 8};
    if (get_buffers(objects, b, 7, names, sizes, 4) < 0) return NULL;
    const uint8_t *data = b[0].view.buf, *extra = b[1].view.buf;
    Py_ssize_t data_size = b[0].view.len, extra_size = b[1].view.len;
    const int64_t *starts = b[2].view.buf, *ends = b[3].view.buf;
    Py_ssize_t docs = b[2].view.len / 8;
    uint64_t *exact = b[4].view.buf, *word_hashes = b[5].view.buf;
    int64_t *word_counts = b[6].view.buf;
    Py_ssize_t word_room = b[5].view.len / 8;
    if (b[3].view.len / 8 != docs || b[4].view.len / 16 != docs || b[6].view.len / 8 != docs)
        return refuse(b, 7, "starts, ends, exact and word_counts disagree on the number of documents");
    for (Py_ssize_t i = 0; i < docs; i++) {
        int in_data = ends[i] <= data_size, in_extra = starts[i] >= data_size && ends[i] <= data_size + extra_size;
        if (starts[i] < 0 || starts[i] > ends[i] || !(in_data || in_extra))
            return refuse(b, 7, "each document must lie inside data, or inside extra (positions from len(data) on)");
    }
    Py_ssize_t words = 0;
    int overflow = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < docs && !overflow; i++) {
        Py_ssize_t words_before = words;
        const uint8_t *start = starts[i] < data_size || ends[i] == starts[i] ? data + starts[i] : extra + (starts[i] - data_size);
        overflow = !tokenize_document(start, start + (ends[i] - starts[i]), exact + 2 * i, word_hashes, &words, word_room);
        word_counts[i] = words - words_before;
    }
    Py_END_ALLOW_THREADS
    if (overflow) return refuse(b, 7, "word_hashes is too small for the batch");
    release(b, 7);
    return PyLong_FromSsize_t(words);
}

/* The inner loop over permutations is what the compiler vectorises; on x86-64 a second copy is built for
   AVX2 (eight 32-bit multiplies and minima at once; SSE2, the baseline, has neither instruction) and picked
   at load time. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static void signature_rows(const uint64_t *shingles, const int64_t *offsets, Py_ssize_t docs,
                           const uint32_t *restrict multipliers, Py_ssize_t perms, uint32_t *restrict out) {
    for (Py_ssize_t i = 0; i < docs; i++) {
        uint32_t *restrict row = out + i * perms;
        for (Py_ssize_t p = 0; p < perms; p++) row[p] = 0xFFFFFFFFu;
        for (int64_t j = offsets[i]; j < offsets[i + 1]; j++) {
            uint32_t key = (uint32_t)(shingles[j] >> 32);
            for (Py_ssize_t p = 0; p < perms; p++) {
                uint32_t value = multipliers[p] * key;
                row[p] = value < row[p] ? value : row[p];
            }
        }
    }
}

static PyObject *signatures(PyObject *self, PyObject *args) {
    PyObject *objects[4];
    if (!PyArg_ParseTuple(args, "OOOO", &objects[0], &objects[1], &objects[2], &objects[3])) return NULL;
    Buffer b[4];
    static const char *names[4] = {"shingles", "offsets", "multipliers", "out"};
    static const Py_ssize_t sizes[4] = {8, 8, 4, 4};
    if (get_buffers(objects, b, 4, names, sizes, 3) < 0) return NULL;
    const int64_t *offsets = b[1].view.buf;
    Py_ssize_t docs = b[1].view.len / 8 - 1, perms = b[2].view.len / 4, shingles = b[0].view.len / 8;
    if (perms <= 0 || !check_offsets(offsets, docs, shingles) || b[3].view.len / 4 != docs * perms) return refuse(b, 4, "signatures: offsets, multipliers and out do not fit together");
    Py_BEGIN_ALLOW_THREADS
    signature_rows(b[0].view.buf, offsets, docs, b[2].view.buf, perms, b[3].view.buf);
    Py_END_ALLOW_THREADS
    release(b, 4);
    Py_RETURN_NONE;
}

static PyObject *shingles(PyObject *self, PyObject *args) {
    PyObject *objects[5];
    if (!PyArg_ParseTuple(args, "OOOOO", &objects[0], &objects[1], &objects[2], &objects[3], &objects[4])) return NULL;
    Buffer b[5];
    static const char *names[5] = {"tokens", "offsets", "weights", "out", "out_counts"};
    static const Py_ssize_t sizes[5] = {8, 8, 8, 8, 8};
    if (get_buffers(objects, b, 5, names, sizes, 3) < 0) return NULL;
    const uint64_t *tokens = b[0].view.buf, *weights = b[2].view.buf;
    const int64_t *offsets = b[1].view.buf;
    uint64_t *out = b[3].view.buf;
    int64_t *counts = b[4].view.buf;
    Py_ssize_t docs = b[1].view.len / 8 - 1, ngram = b[2].view.len / 8, items = b[0].view.len / 8;
    /* Every document yields at most as many shingles as it has tokens. */
    if (ngram < 1 || !check_offsets(offsets, docs, items) || b[3].view.len / 8 < items || b[4].view.len / 8 < docs)
        return refuse(b, 5, "shingles: tokens, offsets, weights and outputs do not fit together");
    Py_ssize_t total = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < docs; i++) {
        const uint64_t *t = tokens + offsets[i];
        Py_ssize_t count = offsets[i + 1] - offsets[i], before = total;
        if (count > 0 && count < ngram) {
            uint64_t sum = 0;
            for (Py_ssize_t k = 0; k < count; k++) sum += t[k] * weights[k];
            out[total++] = mix64(sum);
        }
        for (Py_ssize_t j = 0; j + ngram <= count; j++) {
            uint64_t sum = 0;
            for (Py_ssize_t k = 0; k < ngram; k++) sum += t[j + k] * weights[k];
            out[total++] = mix64(sum);
        }
        counts[i] = total - before;
    }
    Py_END_ALLOW_THREADS
    release(b, 5);
    return PyLong_FromSsize_t(total);
}

static PyObject *intersections(PyObject *self, PyObject *args) {
    PyObject *objects[5];
    if (!PyArg_ParseTuple(args, "OOOOO", &objects[0], &objects[1], &objects[2], &objects[3], &objects[4])) return NULL;
    Buffer b[5];
    static const char *names[5] = {"values", "bounds", "left", "right", "out"};
    static const Py_ssize_t sizes[5] = {8, 8, 8, 8, 8};
    if (get_buffers(objects, b, 5, names, sizes, 4) < 0) return NULL;
    const uint64_t *values = b[0].view.buf;
    const int64_t *bounds = b[1].view.buf, *left = b[2].view.buf, *right = b[3].view.buf;
    int64_t *out = b[4].view.buf;
    Py_ssize_t sets = b[1].view.len / 8 - 1, pairs = b[2].view.len / 8;
    if (!check_offsets(bounds, sets, b[0].view.len / 8) || b[3].view.len / 8 != pairs || b[4].view.len / 8 != pairs
        || !pairs_inside(left, right, pairs, sets))
        return refuse(b, 5, "intersections: values, bounds, pairs and out do not fit together");
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < pairs; k++) {
        const uint64_t *a = values + bounds[left[k]], *a_end = values + bounds[left[k] + 1];
        const uint64_t *c = values + bounds[right[k]], *c_end = values + bounds[right[k] + 1];
        int64_t common = 0;
        while (a < a_end && c < c_end) {
            uint64_t x = *a, y = *c;
            common += x == y;
            a += x <= y;
            c += y <= x;
        }
        out[k] = common;
    }
    Py_END_ALLOW_THREADS
    release(b, 5);
    Py_RETURN_NONE;
}

static PyObject *agreements(PyObject *self, PyObject *args) {
    PyObject *objects[4];
    Py_ssize_t perms;
    if (!PyArg_ParseTuple(args, "OnOOO", &objects[0], &perms, &objects[1], &objects[2], &objects[3])) return NULL;
    Buffer b[4];
    static const char *names[4] = {"signatures", "left", "right", "out"};
    static const Py_ssize_t sizes[4] = {4, 8, 8, 8};
    if (get_buffers(objects, b, 4, names, sizes, 3) < 0) return NULL;
    const uint32_t *sigs = b[0].view.buf;
    const int64_t *left = b[1].view.buf, *right = b[2].view.buf;
    int64_t *out = b[3].view.buf;
    Py_ssize_t pairs = b[1].view.len / 8, docs = perms > 0 ? b[0].view.len / 4 / perms : 0;
    if (perms <= 0 || b[0].view.len / 4 != docs * perms || b[2].view.len / 8 != pairs || b[3].view.len / 8 != pairs
        || !pairs_inside(left, right, pairs, docs))
        return refuse(b, 4, "agreements: signatures, pairs and out do not fit together");
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < pairs; k++) {
        const uint32_t *a = sigs + left[k] * perms, *c = sigs + right[k] * perms;
        int64_t equal = 0;
        for (Py_ssize_t p = 0; p < perms; p++) equal += a[p] == c[p];
        out[k] = equal;
    }
    Py_END_ALLOW_THREADS
    release(b, 4);
    Py_RETURN_NONE;
}

/* The code point of the well-formed UTF-8 sequence at p (before end) and its length, or length 0. */
static inline int decode_utf8(const uint8_t *p, const uint8_t *end, uint32_t *code_point) {
    uint8_t lead = p[0];
    int length = lead >= 0xF0 ? (lead < 0xF5 ? 4 : 0) : lead >= 0xE0 ? 3 : lead >= 0xC2 ? 2 : 0;
    if (length == 0 || end - p < length) return 0;
    uint32_t value = lead & (0x7F >> length);
    for (int k = 1; k < length; k++) {
        if ((p[k] & 0xC0) != 0x80) return 0;
        value = (value << 6) | (p[k] & 0x3F);
    }
    static const uint32_t smallest[5] = {0, 0, 0x80, 0x800, 0x10000};  /* overlong forms are malformed */
    if (value < smallest[length] || (value >= 0xD800 && value < 0xE000) || value > 0x10FFFF) return 0;
    *code_point = value;
    return length;
}

static int document_changes(const uint8_t *p, const uint8_t *end, const uint8_t *table, uint64_t table_bits) {
    while (p < end) {
        if (end - p >= 8) {
            uint64_t x;
            memcpy(&x, p, 8);
            if (!(x & HIGHS)) { p += 8; continue; }  /* eight ASCII bytes: nothing to look up */
        }
        if (*p < 0x80) { p++; continue; }
        uint32_t code_point;
        int length = decode_utf8(p, end, &code_point);
        if (length == 0) { p++; continue; }
        if (code_point >= table_bits || (table[code_point >> 3] >> (code_point & 7) & 1)) return 1;
        p += length;
    }
    return 0;
}

static PyObject *changing_documents(PyObject *self, PyObject *args) {
    PyObject *objects[5];
    if (!PyArg_ParseTuple(args, "OOOOO", &objects[0], &objects[1], &objects[2], &objects[3], &objects[4])) return NULL;
    Buffer b[5];
    static const char *names[5] = {"data", "starts", "ends", "table", "out"};
    static const Py_ssize_t sizes[5] = {1, 8, 8, 1, 1};
    if (get_buffers(objects, b, 5, names, sizes, 4) < 0) return NULL;
    const uint8_t *data = b[0].view.buf, *table = b[3].view.buf;
    const int64_t *starts = b[1].view.buf, *ends = b[2].view.buf;
    uint8_t *out = b[4].view.buf;
    Py_ssize_t docs = b[1].view.len / 8, size = b[0].view.len;
    if (b[2].view.len / 8 != docs || b[4].view.len != docs)
        return refuse(b, 5, "changing_documents: starts, ends and out disagree on the number of documents");
    for (Py_ssize_t i = 0; i < docs; i++)
        if (starts[i] < 0 || starts[i] > ends[i] || ends[i] > size)
            return refuse(b, 5, "changing_documents: each document must lie inside data");
    uint64_t table_bits = (uint64_t)b[3].view.len * 8;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < docs; i++) out[i] = (uint8_t)document_changes(data + starts[i], data + ends[i], table, table_bits);
    Py_END_ALLOW_THREADS
    release(b, 5);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"tokenize", tokenize, METH_VARARGS, "Hash every token and word of a batch of documents (see the file's header)."},
    {"shingles", shingles, METH_VARARGS, "Word (or character) n-gram shingle hashes (see the file's header)."},
    {"intersections", intersections, METH_VARARGS, "Sizes of the intersections of pairs of sorted sets (see the file's header)."},
    {"agreements", agreements, METH_VARARGS, "Equal signature values of pairs of documents (see the file's header)."},
    {"signatures", signatures, METH_VARARGS, "MinHash signatures of a batch of documents (see the file's header)."},
    {"changing_documents", changing_documents, METH_VARARGS, "Documents holding a character of a table (see the file's header)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_minhash", "MinHash kernels; see smolctl/data/minhash/kernels.py.", -1, methods};

PyMODINIT_FUNC PyInit__minhash(void) {
    init_tables();
    return PyModule_Create(&module);
}
