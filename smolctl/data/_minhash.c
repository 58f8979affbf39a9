/* The loops of MinHash dedup that touch every byte, token, shingle x permutation or set member, in C.

   smolctl/data/minhash/kernels.py defines what is computed and does everything else in numpy; these functions only
   fill arrays the caller allocates (no numpy C API: plain buffers), so that a batch of documents is hashed
   in one pass over its bytes instead of a dozen whole-array numpy passes and their temporaries.

   tokenize(data, extra, starts, ends, exact, word_hashes, word_counts) -> words
       Document i is the UTF-8 bytes [starts[i], ends[i]) of data, or of extra when starts[i] >= len(data)
       (counted from len(data)): a batch's arrow buffer with the documents that needed normalising in Python
       placed in a second buffer. A token is a maximal run of non-whitespace bytes, a word the token without
       its leading and trailing ASCII punctuation (none if nothing is left); both are hashed with ASCII letters
       lower-cased (see finish_mixed). Outputs: exact, uint64[n, 2], a 128-bit hash of each document's token
       sequence (see tokenize_document); the word hashes end to end, and the words of each document.
   shingles(tokens, offsets, weights, out, out_counts) -> total
       The n-grams of consecutive tokens of each document, as mix64(sum_k tokens[j + k] * weights[k]); a
       document with 1 to n - 1 tokens has one, of all its tokens. out: uint64 end to end, out_counts per document.
   sorted_sets(values, offsets, out, out_bounds) -> total
       Each document's values[offsets[i]:offsets[i + 1]] sorted and without repeats, end to end in out (at
       least len(values) long), document i owning out[out_bounds[i]:out_bounds[i + 1]]. Each set is sorted where
       it lands, small enough to stay in cache: one sort of every document's values at once runs from memory.
   shared_positions(values, scratch, out) -> count
       The positions i of the values that occur more than once, ordered by (values[i], i), in out[0:count] (int64,
       at least len(values)); scratch holds at least 2 * len(values) uint64. The (value, position) pairs are
       spread over buckets by the values' top bits (one counting pass and one scatter into scratch, positions
       ascending within each bucket), each bucket is sorted by value where it lies, in cache (stable: equal
       values keep their positions' order), and runs of equal values are read off in bucket order. Meant for
       hash values (the top bits uniform); any input is correct, a skewed one slower.
   intersections(values, bounds, left, right, out)
       out[k] = |set left[k] & set right[k]|, set i being the sorted unique values[bounds[i]:bounds[i + 1]].
   agreements(signatures, perms, left, right, out)
       out[k] = how many of the perms values of rows left[k] and right[k] of signatures (uint32[n, perms]) agree.
   signatures(shingles, offsets, multipliers, out)
       out[i, p] = min over the shingle hashes s of document i, shingles[offsets[i]:offsets[i + 1]] (uint64), of
       (uint32)(multipliers[p] * (s >> 32)); 0xFFFFFFFF for a document without shingles. The upper halves are
       read where they lie, not copied out first. out: uint32[n, len(multipliers)], C order.
   changing_documents(data, starts, ends, table, out)
       out[i] = 1 if the UTF-8 bytes [starts[i], ends[i]) of data hold a non-ASCII character whose bit is set in
       table (one bit per code point below 8 * len(table), little-endian within each byte; len(table) >= 16) or
       a character at or above 8 * len(table); else 0. ASCII characters never count. A byte that does not begin
       a well-formed sequence is skipped on its own.
   fold_documents(data, starts, ends, table, folds, classes, out, out_ends)
       Document i's bytes copied to out, the documents end to end from 0, each character whose bit is set in table
       replaced by folds[code point]: uint64, the replacement's UTF-8 bytes packed little-endian in the low 7
       bytes and their number in the top byte (len(folds) == 8 * len(table)). out_ends[i] is where document i
       ends in out (it starts where the one before it that was folded ends), or -1 when it holds a character of
       the table without a replacement (0 in folds, or a length past 7) or at or above 8 * len(table), when a
       character of the table with a class (classes[code point], uint8, same length as folds) follows one with a
       higher class directly, or when its folding does not fit in what is left of out: nothing of it is kept
       then. ASCII, characters outside the table and malformed bytes are copied as they are (class 0).
*/
#include "_buffers.h" /* first: it includes Python.h, which must precede the standard headers */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RADIX 0x100000001B3ULL

/* Where the machine allows it, three kernels take faster instructions than C11 gives: SSE2 (the tokeniser's byte
   classes, changing_documents' ASCII runs), a tokeniser cloned for x86-64-v3 (GCC 12 on: older ones refuse the
   arch name in target_clones, and Linux only: the clones are picked through ifunc), and AVX2 signatures (Linux:
   __builtin_cpu_supports needs libgcc's CPU model, which Apple's toolchain lacks). Defining
   SMOLCTL_PORTABLE_KERNELS builds without any of them, the code other CPUs run: tests/test_minhash_kernels.py
   builds it so to check that both give the same results. */
#if defined(__SSE2__) && !defined(SMOLCTL_PORTABLE_KERNELS)
#define USE_SSE2 1
#endif
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && \
    !defined(SMOLCTL_PORTABLE_KERNELS)
#define CLONED_FOR_X86_64_V3 __attribute__((target_clones("arch=x86-64-v3", "default"), flatten))
#else
#define CLONED_FOR_X86_64_V3
#endif
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(SMOLCTL_PORTABLE_KERNELS)
#define HAVE_AVX2_ROWS 1
#endif


/* splitmix64's finaliser (minhash.mix64). */
static inline uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* A span's hash: its bytes (ASCII letters lower-cased) as 8-byte little-endian chunks c_m, the last one
   zero-padded, summed as sum_m c_m * RADIX^(8m + 1) (mod 2^64; odd multipliers, so a single differing chunk
   always changes the sum), plus length * LENGTH_WEIGHT, times FINISH_MULTIPLIER, then finish_mixed's xorshift.
   The tokeniser multiplies each term by FINISH_MULTIPLIER rather than their sum (multiplying mod 2^64
   distributes over addition): one multiply per 8 bytes and none to finish. */
#define LENGTH_WEIGHT 0x9E3779B97F4A7C15ULL
#define FINISH_MULTIPLIER 0xBF58476D1CE4E5B9ULL

static inline uint64_t finish_mixed(uint64_t mixed) { return (mixed ^ (mixed >> 31)) | 1ULL; }

static inline uint64_t little_endian(uint64_t x) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return __builtin_bswap64(x);
#else
    return x;
#endif
}

/* docs + 1 offsets into `items` values: ascending, and inside (the one offset of zero documents too). */
static int check_offsets(const int64_t *offsets, Py_ssize_t docs, Py_ssize_t items) {
    if (docs < 0 || offsets[0] < 0 || offsets[docs] > items) return 0;
    for (Py_ssize_t i = 0; i < docs; i++)
        if (offsets[i] > offsets[i + 1]) return 0;
    return 1;
}

/* Every pair (left[k], right[k]) names one of `count` rows. */
static int pairs_inside(const int64_t *left, const int64_t *right, Py_ssize_t pairs, Py_ssize_t count) {
    for (Py_ssize_t k = 0; k < pairs; k++)
        if (left[k] < 0 || left[k] >= count || right[k] < 0 || right[k] >= count) return 0;
    return 1;
}

/* A document is tokenised in two passes. The first classifies it 64 bytes at a time into a copy with ASCII
   letters lower-cased and two bitmaps, bit k standing for byte k: space bytes and word bytes. The second walks
   the tokens with counts of trailing zeros over those bitmaps (a token's end, its first and last word bytes)
   and hashes each token's lower-cased copy with masked 8-byte loads: no branch per byte, none per 8 bytes for
   the tokens of real text, and no byte loop for punctuation. */

/* Eight bytes at a time ("SWAR"), the portable classifier: the byte classes of a 64-bit load as masks with
   the high bit of each byte set. */
#define ONES 0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL
#define LOW7 0x7F7F7F7F7F7F7F7FULL

/* High bit of each byte b of x with low < b < high (the "hasbetween" bit hack; exact for every byte). */
static inline uint64_t bytes_between(uint64_t x, unsigned low, unsigned high) {
    uint64_t low7 = x & LOW7;
    return (ONES * (127 + high) - low7) & ~x & (low7 + ONES * (127 - low)) & HIGHS;
}

static inline uint64_t load_little_endian(const uint8_t *p) {
    uint64_t x;
    memcpy(&x, p, 8);
    return little_endian(x);
}

/* RADIX^8, the step between the multipliers of consecutive chunks, and the multipliers of a span's first two
   chunks with FINISH_MULTIPLIER folded in. */
#define RADIX_8 (RADIX * RADIX * RADIX * RADIX * RADIX * RADIX * RADIX * RADIX)
#define FIRST_CHUNK (RADIX * FINISH_MULTIPLIER)
#define SECOND_CHUNK (RADIX_8 * RADIX * FINISH_MULTIPLIER)

/* KEEP[n]: the low n bytes of a 64-bit chunk, n = 0..8. */
static const uint64_t KEEP[9] = {0, 0xFFULL, 0xFFFFULL, 0xFFFFFFULL, 0xFFFFFFFFULL, 0xFFFFFFFFFFULL, 0xFFFFFFFFFFFFULL,
                                 0xFFFFFFFFFFFFFFULL, ~0ULL};

/* SHORT_SPANS[n], n = 0..16: the masks of the two chunks of a span of n bytes and its length's term,
   n * LENGTH_WEIGHT * FINISH_MULTIPLIER, looked up together (set by init_tables). */
typedef struct {
    uint64_t first, second, length_term;
} ShortSpan;

static ShortSpan SHORT_SPANS[17];

/* The hash of the span of 0 to 16 bytes at `lowered`, a lower-cased copy that may be read 16 bytes from the
   span's start: two masked loads, two multiplies and no branch (a second chunk masked to nothing adds zero). */
static inline uint64_t hash_short(const uint8_t *lowered, size_t length) {
    const ShortSpan *span = &SHORT_SPANS[length];
    uint64_t first = load_little_endian(lowered) & span->first, second = load_little_endian(lowered + 8) & span->second;
    return finish_mixed(first * FIRST_CHUNK + second * SECOND_CHUNK + span->length_term);
}

/* hash_lowered of a span of more than 16 bytes: one chunk per 8 bytes. */
__attribute__((noinline)) static uint64_t hash_long(const uint8_t *lowered, size_t length) {
    uint64_t mixed = (uint64_t)length * (LENGTH_WEIGHT * FINISH_MULTIPLIER), multiplier = FIRST_CHUNK;
    size_t k = 0;
    for (; k + 8 <= length; k += 8, multiplier *= RADIX_8) mixed += load_little_endian(lowered + k) * multiplier;
    if (k < length) mixed += (load_little_endian(lowered + k) & KEEP[length - k]) * multiplier;
    return finish_mixed(mixed);
}

/* The hash of any span of a lower-cased copy that may be read 16 bytes past the span's start and 8 past its
   end; the short spans of text inline. */
static inline uint64_t hash_lowered(const uint8_t *lowered, size_t length) {
    return length <= 16 ? hash_short(lowered, length) : hash_long(lowered, length);
}

/* A document classified: `lowered` its bytes with A-Z as a-z, `space` and `word` its bitmaps (bit k of
   bitmap[k / 64] for byte k; `word`'s words stored little-endian). Past the document's end, up to the next
   multiple of 64, the bytes read as spaces; each bitmap has two more words (all space, no word byte), so that a
   64-bit window starting anywhere up to 64 bytes past the end can be read whole. `lowered` has 64 more bytes
   for the hash's loads past a span. */
typedef struct {
    uint8_t *lowered;
    uint64_t *space, *word;
    size_t *bounds;  /* of the tokens of a window of WINDOW_BLOCKS blocks: start, end, start... (tokenize_document) */
} Classified;

/* Tokens are listed from the bitmaps WINDOW_BLOCKS blocks of 64 bytes at a time: at most one start or end per
   byte, a start carried over from the window before, and 7 positions written past the last. */
#define WINDOW_BLOCKS 16
#define BOUNDS_ROOM (64 * WINDOW_BLOCKS + 16)

/* Room for a document of up to `longest` bytes, in one zeroed allocation (NULL when out of memory). calloc, not
   PyMem_RawCalloc: that is not in the 3.11 limited API; it is freed on every path, as tokenize() shows. */
static uint8_t *classified_room(Classified *c, size_t longest) {
    size_t blocks = longest / 64 + 1, bitmap_words = blocks + 2;
    uint8_t *room = calloc(1, sizeof(size_t) * BOUNDS_ROOM + 2 * 8 * bitmap_words + 64 * blocks + 64);
    if (room) {
        c->bounds = (size_t *)room;
        c->space = (uint64_t *)(c->bounds + BOUNDS_ROOM);
        c->word = c->space + bitmap_words;
        c->lowered = (uint8_t *)(c->word + bitmap_words);
    }
    return room;
}

#ifdef USE_SSE2
#include <emmintrin.h>

/* 0xFF for each byte of x in [low, high] (ASCII bounds): x + (128 - low) wraps the range onto the lowest
   signed bytes, so one signed compare tests both ends. */
static inline __m128i in_range(__m128i x, int low, int high) {
    return _mm_cmplt_epi8(_mm_add_epi8(x, _mm_set1_epi8((char)(128 - low))), _mm_set1_epi8((char)(high - low - 127)));
}

/* 64 bytes at `bytes`: lower-cased into `lowered`, their space and word bits returned. */
static inline void classify_block(const uint8_t *bytes, uint8_t *lowered, uint64_t *space, uint64_t *word) {
    uint64_t spaces = 0, words = 0;
    for (int k = 0; k < 4; k++) {
        __m128i x = _mm_loadu_si128((const __m128i *)(bytes + 16 * k));
        __m128i lower = _mm_or_si128(x, _mm_and_si128(in_range(x, 'A', 'Z'), _mm_set1_epi8(0x20)));
        _mm_storeu_si128((__m128i *)(lowered + 16 * k), lower);
        __m128i is_space = _mm_or_si128(in_range(x, 9, 13), in_range(x, 28, 32));  /* \t \n \v \f \r, \x1c-\x1f, ' ' */
        /* x itself contributes its high bit: every non-ASCII byte is a word byte. */
        __m128i is_word = _mm_or_si128(_mm_or_si128(in_range(lower, 'a', 'z'), in_range(x, '0', '9')),
                                       _mm_or_si128(_mm_cmpeq_epi8(x, _mm_set1_epi8('_')), x));
        spaces |= (uint64_t)(uint16_t)_mm_movemask_epi8(is_space) << (16 * k);
        words |= (uint64_t)(uint16_t)_mm_movemask_epi8(is_word) << (16 * k);
    }
    *space = spaces;
    *word = little_endian(words);
}
#else
/* The high bits of the 8 bytes of masks (a SWAR mask) as 8 bits: (masks >> 7) holds bit 8k for byte k, and the
   multiply moves each to bit 56 + k with no two partial products meeting. */
static inline uint64_t gather_high_bits(uint64_t masks) {
    return ((masks >> 7) * 0x0102040810204080ULL) >> 56;
}

static inline void classify_block(const uint8_t *bytes, uint8_t *lowered, uint64_t *space, uint64_t *word) {
    uint64_t spaces = 0, words = 0;
    for (int k = 0; k < 8; k++) {
        uint64_t x = load_little_endian(bytes + 8 * k);
        uint64_t lower = little_endian(x | (bytes_between(x, 64, 91) >> 2));  /* A-Z: 0x20 added */
        memcpy(lowered + 8 * k, &lower, 8);
        uint64_t is_space = bytes_between(x, 8, 14) | bytes_between(x, 27, 33);  /* \t-\r, \x1c-\x1f and ' ' */
        uint64_t is_word = (x & HIGHS) | bytes_between(x, 47, 58) | bytes_between(x, 64, 91)
                           | bytes_between(x, 96, 123) | bytes_between(x, 94, 96);  /* non-ASCII, 0-9, A-Z, a-z, _ */
        spaces |= gather_high_bits(is_space) << (8 * k);
        words |= gather_high_bits(is_word) << (8 * k);
    }
    *space = spaces;
    *word = little_endian(words);
}
#endif

/* The `length` bytes at `bytes` into c; the last partial block through a copy padded with spaces, so that
   nothing past the document is read. */
static void classify(const uint8_t *bytes, size_t length, Classified *c) {
    size_t block = 0;
    for (; 64 * block + 64 <= length; block++)
        classify_block(bytes + 64 * block, c->lowered + 64 * block, &c->space[block], &c->word[block]);
    if (64 * block < length) {
        uint8_t padded[64];
        memset(padded, ' ', sizeof padded);
        memcpy(padded, bytes + 64 * block, length - 64 * block);
        classify_block(padded, c->lowered + 64 * block, &c->space[block], &c->word[block]);
        block++;
    }
    c->space[block] = c->space[block + 1] = ~0ULL;
    c->word[block] = c->word[block + 1] = 0;
}

/* Bits position .. position + 63 of the word bitmap (reads the word after position's). */
static inline uint64_t window(const uint64_t *bitmap, size_t position) {
    size_t i = position / 64;
    unsigned shift = position % 64;
    return (little_endian(bitmap[i]) >> shift) | (little_endian(bitmap[i + 1]) << 1 << (63 - shift));
}

/* Bits position .. position + 56 of the word bitmap, with one unaligned load: its words are stored
   little-endian, so bit k is bit k % 8 of its byte k / 8 on every machine. */
static inline uint64_t bits_at(const uint64_t *bitmap, size_t position) {
    return load_little_endian((const uint8_t *)bitmap + position / 8) >> (position % 8);
}

/* Set bits, without the POPCNT instruction (not in x86-64's baseline). */
static inline size_t count_bits(uint64_t x) {
    x -= (x >> 1) & 0x5555555555555555ULL;
    x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0FULL;
    return (size_t)((x * ONES) >> 56);
}

/* base + the position of each set bit of `bits`, in order, at out; returns how many. Eight are written per
   round, whether there are or not (up to 7 past the last, garbage), so that the loop's branch is taken once
   per 8 bounds, not mispredicted once per token. */
static inline size_t list_positions(uint64_t bits, size_t base, size_t *out) {
    size_t count = count_bits(bits);
    for (size_t k = 0; k < count; k += 8)
        for (int j = 0; j < 8; j++, bits &= bits - 1) out[k + j] = base + __builtin_ctzll(bits | 1ULL << 63);
    return count;
}

/* The lowest n bits, n = 1..64. */
static inline uint64_t low_bits(size_t n) { return ~0ULL >> (64 - n); }

/* The first set bit of bitmap in [from, to), or `to`. */
__attribute__((noinline)) static size_t first_set(const uint64_t *bitmap, size_t from, size_t to) {
    for (size_t q = from; q < to; q += 64) {
        uint64_t bits = window(bitmap, q);
        if (bits) return q + __builtin_ctzll(bits) < to ? q + __builtin_ctzll(bits) : to;
    }
    return to;
}

/* The last set bit of bitmap in [from, to), or `to`. */
__attribute__((noinline)) static size_t last_set(const uint64_t *bitmap, size_t from, size_t to) {
    for (size_t q = to; q > from;) {
        size_t start = q - from > 64 ? q - 64 : from;
        uint64_t bits = window(bitmap, start) & low_bits(q - start);
        if (bits) return start + 63 - __builtin_clzll(bits);
        q = start;
    }
    return to;
}

static const uint64_t EXACT_RADIX[2] = {0x9E3779B97F4A7C15ULL, 0xD6E8FEB86659FD93ULL};

/* EXACT_POWERS[c][k] = EXACT_RADIX[c]^k for up to a window's tokens: they are folded into the exact hash with
   one multiply per token and column, independent of each other (set by init_tables). */
static uint64_t EXACT_POWERS[2][BOUNDS_ROOM / 2 + 1];

static void init_tables(void) {
    for (int n = 0; n <= 16; n++)
        SHORT_SPANS[n] = (ShortSpan){KEEP[n < 8 ? n : 8], KEEP[n > 8 ? n - 8 : 0], n * (LENGTH_WEIGHT * FINISH_MULTIPLIER)};
    for (int column = 0; column < 2; column++) {
        EXACT_POWERS[column][0] = 1;
        for (int k = 1; k <= BOUNDS_ROOM / 2; k++)
            EXACT_POWERS[column][k] = EXACT_POWERS[column][k - 1] * EXACT_RADIX[column];
    }
}

/* The word of the token [start, start + length) of c: the token trimmed to its first and last word bytes.
   Returns 0 if it has none. A token of up to 16 bytes with punctuation (a third of the tokens of web text)
   is trimmed without a branch, `word` written even when there is none. */
static inline int trimmed_word(const Classified *c, size_t start, size_t length, uint64_t token_hash, uint64_t *word) {
    size_t first, last;
    if (length <= 16) {
        uint64_t word_bits = bits_at(c->word, start) & low_bits(length);
        if (word_bits == low_bits(length)) {  /* nothing to trim: the common case, so a branch */
            *word = token_hash;
            return 1;
        }
        uint64_t some_bits = word_bits | !word_bits;  /* no word: a 1-byte span, hashed for nothing */
        first = __builtin_ctzll(some_bits);
        *word = hash_short(c->lowered + start + first, 64 - __builtin_clzll(some_bits) - first);
        return word_bits != 0;
    }
    if (length < 64) {
        uint64_t word_bits = window(c->word, start) & low_bits(length);
        if (!word_bits) return 0;
        first = start + __builtin_ctzll(word_bits);
        last = start + 63 - __builtin_clzll(word_bits);
    } else {
        first = first_set(c->word, start, start + length);
        if (first == start + length) return 0;
        last = last_set(c->word, first, start + length);
    }
    *word = first == start && last == start + length - 1 ? token_hash : hash_lowered(c->lowered + first, last + 1 - first);
    return 1;
}

/* Hashes the `count` listed tokens of c's window, adding sum_t hash_t * EXACT_RADIX[c]^t to window_sums[c], and
   their words into `words`; returns how many words, or -1 if a token began with all `room` taken. */
static Py_ssize_t hash_window(const Classified *c, size_t count, uint64_t window_sums[2], uint64_t *restrict words,
                              Py_ssize_t room) {
    const size_t *restrict bounds = c->bounds;
    uint64_t sum_0 = 0, sum_1 = 0;
    Py_ssize_t written = 0;
    for (size_t t = 0; t < count; t++) {
        if (written >= room) return -1;
        size_t start = bounds[2 * t], length = bounds[2 * t + 1] - start;
        uint64_t hash = hash_lowered(c->lowered + start, length);
        sum_0 += hash * EXACT_POWERS[0][t];
        sum_1 += hash * EXACT_POWERS[1][t];
        written += trimmed_word(c, start, length, hash, &words[written]);
    }
    window_sums[0] = sum_0;
    window_sums[1] = sum_1;
    return written;
}

/* Words and the exact hash of a classified document of `length` bytes; returns 0 if the word room ran out.
   The exact hash is two polynomials sum_i t_i * R^i of the token hashes t_i, finished with the token count. */
static int tokenize_document(Classified *c, size_t length, uint64_t *restrict exact, uint64_t *restrict word_hashes,
                             Py_ssize_t *words_so_far, Py_ssize_t word_room) {
    uint64_t exact_sum[2] = {0, 0}, exact_power[2] = {1, 1}, tokens = 0;
    /* The tokens of a window of blocks are listed first, as the bytes whose class (space or not) differs from
       the byte before's (the document's start counting as a space): a token's start, its end, the next start...;
       then hashed in a loop that finds no token by branching, each token independent of the one before. A token
       still open at the window's end is carried into the next; the last block is the one holding position
       `length`, a space, where the last token ends. */
    uint64_t spaces_before = ~0ULL;
    size_t carried = 0, last_block = length / 64;
    for (size_t first_block = 0; first_block <= last_block; first_block += WINDOW_BLOCKS) {
        size_t bounds = carried;
        for (size_t block = first_block; block <= last_block && block < first_block + WINDOW_BLOCKS; block++) {
            uint64_t spaces = c->space[block], follows_space = spaces << 1 | spaces_before >> 63;
            spaces_before = spaces;
            bounds += list_positions(spaces ^ follows_space, 64 * block, c->bounds + bounds);
        }
        size_t ends = bounds / 2;
        uint64_t window_sums[2];
        Py_ssize_t written = hash_window(c, ends, window_sums, word_hashes + *words_so_far, word_room - *words_so_far);
        if (written < 0) return 0;
        *words_so_far += written;
        for (int column = 0; column < 2; column++) {
            exact_sum[column] += window_sums[column] * exact_power[column];
            exact_power[column] *= EXACT_POWERS[column][ends];
        }
        tokens += ends;
        carried = bounds % 2;
        c->bounds[0] = c->bounds[bounds - carried];
    }
    for (int column = 0; column < 2; column++) exact[column] = mix64(exact_sum[column] ^ tokens * EXACT_RADIX[column]);
    return 1;
}

/* Every document of a batch through classify and tokenize_document; 0 if the word room ran out. Everything it
   calls is inlined (flatten) into each clone: on x86-64 a second copy is built for x86-64-v3, whose BMI
   instructions shift, mask and count the bitmaps' bits without going through the CL register, picked at load
   time. hash_long, first_set and last_set (spans past 16 bytes, tokens of 64 bytes or more: rare) are kept out of
   line, so that the loop over tokens has registers enough not to spill its sums to the stack. */
CLONED_FOR_X86_64_V3
static int tokenize_batch(const uint8_t *data, Py_ssize_t data_size, const uint8_t *extra, const int64_t *starts,
                          const int64_t *ends, Py_ssize_t docs, Classified *classified, uint64_t *exact,
                          uint64_t *word_hashes, int64_t *word_counts, Py_ssize_t *words, Py_ssize_t word_room) {
    for (Py_ssize_t i = 0; i < docs; i++) {
        Py_ssize_t words_before = *words;
        const uint8_t *start = starts[i] < data_size || ends[i] == starts[i] ? data + starts[i] : extra + (starts[i] - data_size);
        size_t length = (size_t)(ends[i] - starts[i]);
        classify(start, length, classified);
        if (!tokenize_document(classified, length, exact + 2 * i, word_hashes, words, word_room)) return 0;
        word_counts[i] = *words - words_before;
    }
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
    size_t longest = 0;
    for (Py_ssize_t i = 0; i < docs; i++) {
        int in_data = ends[i] <= data_size, in_extra = starts[i] >= data_size && ends[i] <= data_size + extra_size;
        if (starts[i] < 0 || starts[i] > ends[i] || !(in_data || in_extra))
            return refuse(b, 7, "each document must lie inside data, or inside extra (positions from len(data) on)");
        if ((size_t)(ends[i] - starts[i]) > longest) longest = (size_t)(ends[i] - starts[i]);
    }
    Classified classified;
    uint8_t *room = classified_room(&classified, longest);
    if (!room) {
        release(b, 7);
        return PyErr_NoMemory();
    }
    Py_ssize_t words = 0;
    int overflow = 0;
    Py_BEGIN_ALLOW_THREADS
    overflow = !tokenize_batch(data, data_size, extra, starts, ends, docs, &classified, exact, word_hashes, word_counts,
                               &words, word_room);
    Py_END_ALLOW_THREADS
    free(room);
    if (overflow) return refuse(b, 7, "word_hashes is too small for the batch");
    release(b, 7);
    return PyLong_FromSsize_t(words);
}

/* The loop over permutations is what the compiler vectorises (SSE2, the baseline, has no 32-bit multiply or
   unsigned minimum: it emulates them). Each key reads and writes the whole row. */
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

#ifdef HAVE_AVX2_ROWS
#include <immintrin.h>

/* The minima of `vectors` x 8 permutations (a constant where it is inlined) over the keys [first, end), held in
   registers from the first key to the last: the row is written once, not read and written once per key. */
__attribute__((target("avx2"), always_inline)) static inline void
minima_in_registers(const uint64_t *shingles, int64_t first, int64_t end, const uint32_t *multipliers, uint32_t *row,
                    int vectors) {
    __m256i minima[8];
    for (int v = 0; v < vectors; v++) minima[v] = _mm256_set1_epi32(-1);
    for (int64_t j = first; j < end; j++) {
        __m256i key = _mm256_set1_epi32((int)(uint32_t)(shingles[j] >> 32));
        for (int v = 0; v < vectors; v++) {
            __m256i multiplier = _mm256_loadu_si256((const __m256i *)(multipliers + 8 * v));
            minima[v] = _mm256_min_epu32(minima[v], _mm256_mullo_epi32(multiplier, key));
        }
    }
    for (int v = 0; v < vectors; v++) _mm256_storeu_si256((__m256i *)(row + 8 * v), minima[v]);
}

/* signature_rows with AVX2, in blocks of up to 64 permutations (8 registers of minima, 16 in all), the last
   fewer than 8 one at a time; picked at run time where the CPU has AVX2. */
__attribute__((target("avx2"))) static void signature_rows_avx2(const uint64_t *shingles, const int64_t *offsets,
                                                                Py_ssize_t docs, const uint32_t *multipliers,
                                                                Py_ssize_t perms, uint32_t *out) {
    for (Py_ssize_t i = 0; i < docs; i++) {
        uint32_t *row = out + i * perms;
        int64_t first = offsets[i], end = offsets[i + 1];
        Py_ssize_t p = 0;
        for (; perms - p >= 64; p += 64) minima_in_registers(shingles, first, end, multipliers + p, row + p, 8);
        if (perms - p >= 32) minima_in_registers(shingles, first, end, multipliers + p, row + p, 4), p += 32;
        if (perms - p >= 16) minima_in_registers(shingles, first, end, multipliers + p, row + p, 2), p += 16;
        if (perms - p >= 8) minima_in_registers(shingles, first, end, multipliers + p, row + p, 1), p += 8;
        if (p < perms) signature_rows(shingles, offsets + i, 1, multipliers + p, perms - p, row + p);
    }
}
#endif

static PyObject *signatures(PyObject *self, PyObject *args) {
    PyObject *objects[4];
    if (!PyArg_ParseTuple(args, "OOOO", &objects[0], &objects[1], &objects[2], &objects[3])) return NULL;
    Buffer b[4];
    static const char *names[4] = {"shingles", "offsets", "multipliers", "out"};
    static const Py_ssize_t sizes[4] = {8, 8, 4, 4};
    if (get_buffers(objects, b, 4, names, sizes, 3) < 0) return NULL;
    const int64_t *offsets = b[1].view.buf;
    Py_ssize_t docs = b[1].view.len / 8 - 1, perms = b[2].view.len / 4, items = b[0].view.len / 8;
    if (perms <= 0 || !check_offsets(offsets, docs, items) || b[3].view.len / 4 != docs * perms)
        return refuse(b, 4, "signatures: shingles, offsets, multipliers and out do not fit together");
    Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_AVX2_ROWS
    if (__builtin_cpu_supports("avx2"))
        signature_rows_avx2(b[0].view.buf, offsets, docs, b[2].view.buf, perms, b[3].view.buf);
    else
#endif
        signature_rows(b[0].view.buf, offsets, docs, b[2].view.buf, perms, b[3].view.buf);
    Py_END_ALLOW_THREADS
    release(b, 4);
    Py_RETURN_NONE;
}

/* The shingles of one document's `count` tokens into out; returns how many. Inlined with ngram a constant for
   dedup's 5 words: the sum unrolls and the weights stay in registers (restrict: out never overlaps them). */
static inline __attribute__((always_inline)) Py_ssize_t
document_shingles(const uint64_t *restrict t, Py_ssize_t count, const uint64_t *restrict weights, Py_ssize_t ngram,
                  uint64_t *restrict out) {
    Py_ssize_t written = 0;
    if (count > 0 && count < ngram) {
        uint64_t sum = 0;
        for (Py_ssize_t k = 0; k < count; k++) sum += t[k] * weights[k];
        out[written++] = mix64(sum);
    }
    for (Py_ssize_t j = 0; j + ngram <= count; j++) {
        uint64_t sum = 0;
        for (Py_ssize_t k = 0; k < ngram; k++) sum += t[j + k] * weights[k];
        out[written++] = mix64(sum);
    }
    return written;
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
        Py_ssize_t count = offsets[i + 1] - offsets[i];
        counts[i] = ngram == 5 ? document_shingles(t, count, weights, 5, out + total)
                               : document_shingles(t, count, weights, ngram, out + total);
        total += counts[i];
    }
    Py_END_ALLOW_THREADS
    release(b, 5);
    return PyLong_FromSsize_t(total);
}

/* Introsort: quicksort with median-of-three pivots and Hoare partitions (a run of equal values splits evenly),
   insertion sort for short ranges, heapsort past 2 log2(n) levels, so that no document (one shingle repeated,
   two alternating) costs more than n log n. The median of three samples at distinct positions is never a
   unique maximum, so each partition leaves both sides non-empty. */
static void insertion_sort(uint64_t *a, Py_ssize_t n) {
    for (Py_ssize_t i = 1; i < n; i++) {
        uint64_t x = a[i];
        Py_ssize_t j = i;
        for (; j > 0 && a[j - 1] > x; j--) a[j] = a[j - 1];
        a[j] = x;
    }
}

static void sift_down(uint64_t *a, Py_ssize_t root, Py_ssize_t n) {
    uint64_t x = a[root];
    for (Py_ssize_t child = 2 * root + 1; child < n; child = 2 * root + 1) {
        if (child + 1 < n && a[child + 1] > a[child]) child++;
        if (a[child] <= x) break;
        a[root] = a[child];
        root = child;
    }
    a[root] = x;
}

static void heap_sort(uint64_t *a, Py_ssize_t n) {
    for (Py_ssize_t i = n / 2 - 1; i >= 0; i--) sift_down(a, i, n);
    for (Py_ssize_t end = n - 1; end > 0; end--) {
        uint64_t top = a[0];
        a[0] = a[end];
        a[end] = top;
        sift_down(a, 0, end);
    }
}

static void intro_sort(uint64_t *a, Py_ssize_t n, int depth) {
    while (n > 16) {
        if (depth-- == 0) {
            heap_sort(a, n);
            return;
        }
        uint64_t x = a[0], y = a[n / 2], z = a[n - 1];
        uint64_t pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        Py_ssize_t i = -1, j = n;
        for (;;) {
            do i++; while (a[i] < pivot);
            do j--; while (a[j] > pivot);
            if (i >= j) break;
            uint64_t t = a[i];
            a[i] = a[j];
            a[j] = t;
        }
        Py_ssize_t left = j + 1; /* a[0, left) <= pivot <= a[left, n); the smaller side recurses */
        if (left < n - left) {
            intro_sort(a, left, depth);
            a += left;
            n -= left;
        } else {
            intro_sort(a + left, n - left, depth);
            n = left;
        }
    }
    insertion_sort(a, n);
}

static int sort_depth(Py_ssize_t count) {
    int depth = 0;
    for (Py_ssize_t m = count; m > 1; m >>= 1) depth += 2;
    return depth;
}

static PyObject *sorted_sets(PyObject *self, PyObject *args) {
    PyObject *objects[4];
    if (!PyArg_ParseTuple(args, "OOOO", &objects[0], &objects[1], &objects[2], &objects[3])) return NULL;
    Buffer b[4];
    static const char *names[4] = {"values", "offsets", "out", "out_bounds"};
    static const Py_ssize_t sizes[4] = {8, 8, 8, 8};
    if (get_buffers(objects, b, 4, names, sizes, 2) < 0) return NULL;
    const uint64_t *values = b[0].view.buf;
    const int64_t *offsets = b[1].view.buf;
    uint64_t *out = b[2].view.buf;
    int64_t *bounds = b[3].view.buf;
    Py_ssize_t docs = b[1].view.len / 8 - 1, items = b[0].view.len / 8;
    if (!check_offsets(offsets, docs, items) || b[2].view.len / 8 < items || b[3].view.len / 8 != docs + 1)
        return refuse(b, 4, "sorted_sets: values, offsets and outputs do not fit together");
    Py_ssize_t total = 0;
    Py_BEGIN_ALLOW_THREADS
    bounds[0] = 0;
    for (Py_ssize_t i = 0; i < docs; i++) {
        Py_ssize_t count = offsets[i + 1] - offsets[i], kept = count > 0;
        uint64_t *set = out + total;
        memmove(set, values + offsets[i], (size_t)count * sizeof(uint64_t));
        intro_sort(set, count, sort_depth(count));
        for (Py_ssize_t k = 1; k < count; k++)
            if (set[k] != set[kept - 1]) set[kept++] = set[k];
        total += kept;
        bounds[i + 1] = total;
    }
    Py_END_ALLOW_THREADS
    release(b, 4);
    return PyLong_FromSsize_t(total);
}

typedef struct {
    uint64_t value;
    int64_t position;
} Keyed;

/* Both sorts are stable: equal values keep the order they were scattered in (ascending positions). */
static void insertion_sort_keyed(Keyed *a, Py_ssize_t n) {
    for (Py_ssize_t i = 1; i < n; i++) {
        Keyed x = a[i];
        Py_ssize_t j = i;
        for (; j > 0 && a[j - 1].value > x.value; j--) a[j] = a[j - 1];
        a[j] = x;
    }
}

/* Runs of 16 by insertion, then merged bottom-up through tmp (room for n items): n log n for a
   bucket of many equal or clustered values, as one large templated-page bucket gives. */
static void merge_sort_keyed(Keyed *a, Py_ssize_t n, Keyed *tmp) {
    const Py_ssize_t run = 16;
    for (Py_ssize_t lo = 0; lo < n; lo += run) insertion_sort_keyed(a + lo, n - lo < run ? n - lo : run);
    for (Py_ssize_t width = run; width < n; width *= 2) {
        for (Py_ssize_t lo = 0; lo + width < n; lo += 2 * width) {
            Py_ssize_t mid = lo + width, hi = mid + width < n ? mid + width : n;
            if (a[mid - 1].value <= a[mid].value) continue; /* the two runs are in order already */
            Py_ssize_t left = mid - lo, i = 0, j = mid, k = lo;
            memcpy(tmp, a + lo, (size_t)left * sizeof(Keyed));
            while (i < left && j < hi) a[k++] = a[j].value < tmp[i].value ? a[j++] : tmp[i++];
            while (i < left) a[k++] = tmp[i++];
        }
    }
}

static PyObject *shared_positions(PyObject *self, PyObject *args) {
    PyObject *objects[3];
    if (!PyArg_ParseTuple(args, "OOO", &objects[0], &objects[1], &objects[2])) return NULL;
    Buffer b[3];
    static const char *names[3] = {"values", "scratch", "out"};
    static const Py_ssize_t sizes[3] = {8, 8, 8};
    if (get_buffers(objects, b, 3, names, sizes, 1) < 0) return NULL;
    const uint64_t *values = b[0].view.buf;
    Keyed *scratch = b[1].view.buf;
    int64_t *out = b[2].view.buf;
    Py_ssize_t n = b[0].view.len / 8;
    if (b[1].view.len / 16 < n || b[2].view.len / 8 < n)
        return refuse(b, 3, "shared_positions: scratch is shorter than 2 x values or out than values");
    /* ~16 values a bucket, at most 2^20 buckets (8 MB of bucket ends). */
    int bits = 1;
    while (bits < 20 && ((Py_ssize_t)1 << (bits + 4)) < n) bits++;
    Py_ssize_t buckets = (Py_ssize_t)1 << bits;
    Py_ssize_t *ends = calloc((size_t)buckets, sizeof(Py_ssize_t));
    if (ends == NULL) {
        release(b, 3);
        return PyErr_NoMemory();
    }
    const int shift = 64 - bits;
    Py_ssize_t largest = 0, start = 0;
    for (Py_ssize_t i = 0; i < n; i++) ends[values[i] >> shift]++;
    for (Py_ssize_t k = 0; k < buckets; k++) { /* each bucket's start; the scatter moves it to the bucket's end */
        Py_ssize_t size = ends[k];
        if (size > largest) largest = size;
        ends[k] = start;
        start += size;
    }
    Keyed *tmp = largest > 16 ? malloc((size_t)largest * sizeof(Keyed)) : NULL;
    if (largest > 16 && tmp == NULL) {
        free(ends);
        release(b, 3);
        return PyErr_NoMemory();
    }
    Py_ssize_t count = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        Keyed *slot = scratch + ends[values[i] >> shift]++;
        slot->value = values[i];
        slot->position = (int64_t)i;
    }
    start = 0;
    for (Py_ssize_t k = 0; k < buckets; k++) {
        Keyed *bucket = scratch + start;
        Py_ssize_t size = ends[k] - start;
        start = ends[k];
        if (size > 16)
            merge_sort_keyed(bucket, size, tmp);
        else
            insertion_sort_keyed(bucket, size);
        for (Py_ssize_t i = 0; i < size;) {
            Py_ssize_t j = i + 1;
            while (j < size && bucket[j].value == bucket[i].value) j++;
            if (j - i > 1)
                for (Py_ssize_t m = i; m < j; m++) out[count++] = bucket[m].position;
            i = j;
        }
    }
    Py_END_ALLOW_THREADS
    free(tmp);
    free(ends);
    release(b, 3);
    return PyLong_FromSsize_t(count);
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

/* The first byte at or after p, before end, that is not ASCII (or end). */
static inline const uint8_t *skip_ascii(const uint8_t *p, const uint8_t *end) {
#ifdef USE_SSE2
    for (; end - p >= 16; p += 16) {
        int highs = _mm_movemask_epi8(_mm_loadu_si128((const __m128i *)p));
        if (highs) return p + __builtin_ctz((unsigned)highs);
    }
#endif
    for (; end - p >= 8; p += 8) {
        uint64_t x;
        memcpy(&x, p, 8);
        if (x & HIGHS) break;
    }
    while (p < end && *p < 0x80) p++;
    return p;
}

static int document_changes(const uint8_t *p, const uint8_t *end, const uint8_t *table, uint64_t table_bits) {
    while ((p = skip_ascii(p, end)) < end) {  /* ASCII characters never change */
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
    if (b[3].view.len < 16) return refuse(b, 5, "changing_documents: the table must cover the 128 ASCII code points");
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

/* Copies [p, end) to [out, limit) with the table's characters replaced: the bytes written, or -1 as soon as one
   has no replacement, a class goes down or the next piece would not fit before limit. */
static Py_ssize_t fold_document(const uint8_t *p, const uint8_t *end, uint8_t *out, const uint8_t *limit,
                                const uint8_t *table, const uint64_t *folds, const uint8_t *classes,
                                uint64_t table_bits) {
    uint8_t *start = out;
    int previous_class = 0;
    while (p < end) {
        if (end - p >= 8 && limit - out >= 8) {
            uint64_t x;
            memcpy(&x, p, 8);
            if (!(x & HIGHS)) {
                memcpy(out, p, 8);
                p += 8;
                out += 8;
                previous_class = 0;
                continue;
            }
        }
        uint32_t code_point;
        int length = *p < 0x80 ? 0 : decode_utf8(p, end, &code_point);
        if (length == 0) {
            if (out == limit) return -1;
            *out++ = *p++;
            previous_class = 0;
            continue;
        }
        if (code_point >= table_bits) return -1;
        if (table[code_point >> 3] >> (code_point & 7) & 1) {
            uint64_t folded = folds[code_point];
            int folded_length = (int)(folded >> 56), combining_class = classes[code_point];
            if (folded_length == 0 || folded_length > 7 || limit - out < folded_length) return -1;
            if (combining_class != 0 && combining_class < previous_class) return -1;
            previous_class = combining_class;
            for (int k = 0; k < folded_length; k++) out[k] = (uint8_t)(folded >> (8 * k));
            out += folded_length;
        } else {
            if (limit - out < length) return -1;
            memcpy(out, p, (size_t)length);
            out += length;
            previous_class = 0;
        }
        p += length;
    }
    return out - start;
}

static PyObject *fold_documents(PyObject *self, PyObject *args) {
    PyObject *objects[8];
    if (!PyArg_ParseTuple(args, "OOOOOOOO", &objects[0], &objects[1], &objects[2], &objects[3], &objects[4],
                          &objects[5], &objects[6], &objects[7]))
        return NULL;
    Buffer b[8];
    static const char *names[8] = {"data", "starts", "ends", "table", "folds", "classes", "out", "out_ends"};
    static const Py_ssize_t sizes[8] = {1, 8, 8, 1, 8, 1, 1, 8};
    if (get_buffers(objects, b, 8, names, sizes, 6) < 0) return NULL;
    const uint8_t *data = b[0].view.buf, *table = b[3].view.buf, *classes = b[5].view.buf;
    const int64_t *starts = b[1].view.buf, *ends = b[2].view.buf;
    const uint64_t *folds = b[4].view.buf;
    uint8_t *out = b[6].view.buf;
    int64_t *out_ends = b[7].view.buf;
    Py_ssize_t docs = b[1].view.len / 8, size = b[0].view.len;
    if (b[2].view.len / 8 != docs || b[7].view.len / 8 != docs)
        return refuse(b, 8, "fold_documents: starts, ends and out_ends disagree on the number of documents");
    if (b[3].view.len < 16 || b[4].view.len / 8 != b[3].view.len * 8 || b[5].view.len != b[3].view.len * 8)
        return refuse(b, 8, "fold_documents: folds and classes must hold one entry per code point of the table");
    for (Py_ssize_t i = 0; i < docs; i++) {
        if (starts[i] < 0 || starts[i] > ends[i] || ends[i] > size)
            return refuse(b, 8, "fold_documents: each document must lie inside data");
    }
    uint64_t table_bits = (uint64_t)b[3].view.len * 8;
    const uint8_t *limit = out + b[6].view.len;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t position = 0;
    for (Py_ssize_t i = 0; i < docs; i++) {
        Py_ssize_t written = fold_document(data + starts[i], data + ends[i], out + position, limit, table, folds,
                                           classes, table_bits);
        if (written >= 0) position += written;
        out_ends[i] = written >= 0 ? position : -1;
    }
    Py_END_ALLOW_THREADS
    release(b, 8);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"tokenize", tokenize, METH_VARARGS, "Hash every token and word of a batch of documents (see the file's header)."},
    {"shingles", shingles, METH_VARARGS, "Word (or character) n-gram shingle hashes (see the file's header)."},
    {"sorted_sets", sorted_sets, METH_VARARGS, "Each document's values sorted and without repeats (see the file's header)."},
    {"shared_positions", shared_positions, METH_VARARGS, "Positions of the values occurring more than once (see the file's header)."},
    {"intersections", intersections, METH_VARARGS, "Sizes of the intersections of pairs of sorted sets (see the file's header)."},
    {"agreements", agreements, METH_VARARGS, "Equal signature values of pairs of documents (see the file's header)."},
    {"signatures", signatures, METH_VARARGS, "MinHash signatures of a batch of documents (see the file's header)."},
    {"fold_documents", fold_documents, METH_VARARGS, "Documents with the table's characters replaced (see the file's header)."},
    {"changing_documents", changing_documents, METH_VARARGS, "Documents holding a character of a table (see the file's header)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_minhash", "MinHash kernels; see smolctl/data/minhash/kernels.py.", -1, methods};

PyMODINIT_FUNC PyInit__minhash(void) {
    init_tables();
    return PyModule_Create(&module);
}
