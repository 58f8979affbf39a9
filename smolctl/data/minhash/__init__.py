"""Vectorised MinHash over whole batches of documents (no I/O), one module per concern.

    from smolctl.data.minhash import kernels, params
    minhash = params.MinHashParams.for_threshold(0.8)
    tokens = kernels.tokenize(texts)                                         # normalised, hashed words
    shingles, offsets = kernels.ngrams(tokens.words, tokens.word_offsets, minhash.ngram)
    signatures = kernels.signatures(shingles, offsets, minhash.permutations())  # (docs, num_perm) uint32

- params:        what decides which documents are near duplicates (threshold, bands x rows, shingles, seed)
- normalization: Unicode NFKC + case folding, and which documents need it beyond ASCII lower-casing
- kernels:       the C kernels of _minhash.c behind numpy signatures (tokens, n-grams, signatures, set overlaps)
- shingles:      shingle sets of texts (word or character n-grams) and their exact Jaccard
- lsh:           band keys and the candidate pairs of documents sharing one
- arrays:        integer-array helpers (a fixed 64-bit mixer, unique by sorting, union-find over edges)

The per-document Python loop of the usual implementations (datasketch hashes every shingle with sha1 in Python)
is replaced by passes over a whole batch: tokens and words are found and hashed in one C call over the batch's
UTF-8 bytes (_minhash.c), shingles are combinations of consecutive word hashes, and every permutation of every shingle is one
uint32 multiply and minimum.
"""
