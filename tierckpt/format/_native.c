/*
 * tierckpt.format._native: the per-tensor loops of the data path, without the GIL.
 *
 * Restoring 20,000 small tensors in Python costs ~10 us each in interpreter overhead around a hash
 * and a copy that take ~3 us: the restoring thread, not the disk, set the speed (docs/io.md, "Copying bytes").
 * These functions run the same loop over a table of records in C.
 *
 * The checksum is not implemented here: the caller hands in the address of xxhash's own
 * XXH3_64bits (from the python-xxhash extension or libxxhash, see tierckpt/format/native.py), checked
 * against xxhash.xxh3_64_intdigest before it is used. So this file needs nothing but Python.h and
 * libc to build.
 *
 * Addresses are trusted: the caller (tierckpt.format.native) keeps the memory alive, and the manifest's
 * validation has bounded every extent by its blob.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

typedef uint64_t (*hash_fn)(const void *, size_t);

static hash_fn xxh3 = NULL;

/* One tensor, in the order of the bytes on disk: its extent in the blob, its checksum, and where its
 * bytes go (0: nowhere, verify only). Four native-endian uint64, as array('Q') lays them out. */
typedef struct {
    uint64_t off, len, sum, dst;
} rec_t;

static int all_zero(const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) {
        if (*p++) return 0;
        n--;
    }
    const uint64_t *w = (const uint64_t *)p;
    for (; n >= 64; n -= 64, w += 8)
        if (w[0] | w[1] | w[2] | w[3] | w[4] | w[5] | w[6] | w[7]) return 0;
    for (; n >= 8; n -= 8)
        if (*w++) return 0;
    p = (const unsigned char *)w;
    while (n--)
        if (*p++) return 0;
    return 1;
}

/* Copy with non-temporal stores where the CPU has them (x86-64 always has SSE2): a restored tensor
 * is not read again soon, and streaming stores skip reading every destination cache line before
 * writing it. 20,000 copies of 1-64 KiB ran at 8.5 GB/s this way, 6.8 GB/s with memcpy. */
static void copy_out(void *dst, const void *src, size_t n) {
#if defined(__SSE2__)
    unsigned char *d = (unsigned char *)dst;
    const unsigned char *s = (const unsigned char *)src;
    if (n >= 256) {
        size_t head = (16 - ((uintptr_t)d & 15)) & 15;
        memcpy(d, s, head);
        d += head, s += head, n -= head;
        for (; n >= 64; n -= 64, d += 64, s += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16)),
                    c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
        }
    }
    memcpy(d, s, n);
#else
    memcpy(dst, src, n);
#endif
}

static void copies_done(void) {
#if defined(__SSE2__)
    _mm_sfence(); /* streaming stores are weakly ordered: make them visible before returning */
#endif
}

static int need_hash(void) {
    if (xxh3 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "tierckpt.format._native: set_hash() was not called");
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(set_hash_doc,
             "set_hash(address, /)\n--\n\n"
             "Use the function at ``address`` (``uint64_t f(const void *, size_t)``, XXH3_64bits) as the "
             "checksum.");

static PyObject *set_hash(PyObject *self, PyObject *arg) {
    void *p = PyLong_AsVoidPtr(arg);
    if (p == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null function address");
        return NULL;
    }
    xxh3 = (hash_fn)p;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(digest_doc,
             "digest(buffer, address=None, /)\n--\n\n"
             "The checksum of a buffer's bytes (GIL released), by the function at ``address`` if given (to "
             "check a candidate before set_hash), else by the one set.");

static PyObject *digest(PyObject *self, PyObject *args) {
    PyObject *buffer, *address = Py_None;
    Py_buffer b;
    uint64_t h;
    hash_fn fn = xxh3;
    if (!PyArg_ParseTuple(args, "O|O", &buffer, &address)) return NULL;
    if (address != Py_None) {
        fn = (hash_fn)PyLong_AsVoidPtr(address);
        if (fn == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null function address");
            return NULL;
        }
    } else if (!need_hash()) {
        return NULL;
    }
    if (PyObject_GetBuffer(buffer, &b, PyBUF_SIMPLE) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    h = fn(b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

PyDoc_STRVAR(is_zero_doc, "is_zero(address, nbytes, /)\n--\n\nWhether ``nbytes`` at ``address`` are all zero.");

static PyObject *is_zero(PyObject *self, PyObject *args) {
    unsigned long long addr, n;
    int z;
    if (!PyArg_ParseTuple(args, "KK", &addr, &n)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    z = all_zero((const unsigned char *)(uintptr_t)addr, (size_t)n);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(z);
}

/* Check a record table and the range of a call on it; on failure release it and set ValueError. */
static int valid(Py_buffer *recs, Py_ssize_t k, Py_ssize_t stop, uint64_t cursor, uint64_t p0, uint64_t n,
                 const char *what) {
    Py_ssize_t count = recs->len / (Py_ssize_t)sizeof(rec_t);
    if (recs->len % (Py_ssize_t)sizeof(rec_t) || k < 0 || stop < k || stop > count || cursor < p0 ||
        cursor > p0 + n) {
        PyBuffer_Release(recs);
        PyErr_Format(PyExc_ValueError, "%s: bad record table or range", what);
        return 0;
    }
    return 1;
}

/* One run of the scatter loop: records [k, stop) of a piece [p0, p1) found at ``piece``. */
typedef struct {
    const rec_t *r;
    Py_ssize_t k, stop;
    const unsigned char *piece;
    uint64_t p0, p1, cursor, max_len;
    int err;
    uint64_t ga, gb;
} job_t;

static void run_job(job_t *j) {
    const rec_t *r = j->r;
    Py_ssize_t k = j->k;
    uint64_t cursor = j->cursor;
    for (; k < j->stop; k++) {
        const uint64_t o = r[k].off, len = r[k].len, e = o + len;
        if (o < j->p0 || e > j->p1 || len > j->max_len) break;
        if (o > cursor && !all_zero(j->piece + (cursor - j->p0), (size_t)(o - cursor))) {
            j->err = 2, j->ga = cursor, j->gb = o;
            break;
        }
        const unsigned char *src = j->piece + (o - j->p0);
        if (xxh3(src, (size_t)len) != r[k].sum) {
            j->err = 1;
            cursor = o;
            break;
        }
        if (r[k].dst && r[k].dst != (uint64_t)(uintptr_t)src) copy_out((void *)(uintptr_t)r[k].dst, src, (size_t)len);
        cursor = e;
    }
    copies_done();
    j->k = k;
    j->cursor = cursor;
}

static void *job_thread(void *arg) {
    run_job((job_t *)arg);
    return NULL;
}

#define MAX_THREADS 8
#define SPLIT_MIN_BYTES (1u << 20) /* below this a thread costs more than it saves */

/* Run ``j`` on up to ``threads`` threads: the records it would take (wholly inside the piece, at
 * most max_len each) are cut into parts of about equal bytes, each started at the end of the one
 * before. The result is that of the first part that failed, else that of the last part. */
static void run_split(job_t *j, int threads) {
    const rec_t *r = j->r;
    Py_ssize_t e = j->k;
    uint64_t total = 0;
    while (e < j->stop && r[e].off >= j->p0 && r[e].off + r[e].len <= j->p1 && r[e].len <= j->max_len)
        total += r[e++].len;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > e - j->k) threads = (int)(e - j->k);
    if (threads < 2 || total < SPLIT_MIN_BYTES) {
        run_job(j);
        return;
    }
    job_t parts[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    Py_ssize_t k = j->k;
    uint64_t acc = 0;
    for (int t = 0; t < threads; t++) {
        parts[t] = *j;
        parts[t].k = k;
        if (t > 0) parts[t].cursor = r[k - 1].off + r[k - 1].len;
        uint64_t goal = total / (uint64_t)threads * (uint64_t)(t + 1);
        Py_ssize_t stop = k;
        if (t == threads - 1) {
            stop = e;
        } else {
            while (stop < e && (acc < goal || stop == k)) acc += r[stop++].len;
            if (stop == e) threads = t + 1; /* the rest went into this part */
        }
        parts[t].stop = stop;
        k = stop;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&tids[t], NULL, job_thread, &parts[t]) == 0;
    run_job(&parts[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(tids[t], NULL);
        else if (parts[t - 1].err == 0)
            run_job(&parts[t]); /* no thread: run it here, in order */
    }
    int t = 0;
    while (t < threads - 1 && parts[t].err == 0 && parts[t].k == parts[t].stop) t++;
    /* parts[t] is the first that failed, or the last; a later part may have copied verified bytes */
    j->k = parts[t].k, j->cursor = parts[t].cursor, j->err = parts[t].err, j->ga = parts[t].ga, j->gb = parts[t].gb;
}

PyDoc_STRVAR(
    scatter_doc,
    "scatter(recs, k, stop, base, p0, n, cursor, max_len, threads=1, /) -> (k, cursor, err, a, b)\n--\n\n"
    "Verify, and copy out, the tensors of a piece of a blob: bytes [p0, p0 + n) of the blob, found at\n"
    "address ``base``. ``recs`` holds 4 uint64 per tensor (offset, length, checksum, destination), in\n"
    "blob order. From record ``k`` on (not past ``stop``), for every tensor wholly inside the piece\n"
    "and at most ``max_len`` bytes long: the bytes between ``cursor`` and its offset must be zero; its\n"
    "checksum must match; then it is copied to its destination (if not 0 and not already there).\n"
    "Stops at the first tensor that does not qualify. Returns the next record, the new cursor (the\n"
    "blob offset up to which everything was checked) and ``err``: 0, 1 (checksum mismatch of record\n"
    "``k``) or 2 (non-zero bytes in [a, b) of the blob). With ``threads`` > 1, runs of at least 1 MiB\n"
    "are split over that many threads; after an error, tensors after the failed one may then have\n"
    "been copied too (with verified bytes).");

static PyObject *scatter(PyObject *self, PyObject *args) {
    Py_buffer recs;
    Py_ssize_t k, stop;
    unsigned long long base, p0, n, cursor, max_len;
    int threads = 1;
    if (!need_hash()) return NULL;
    if (!PyArg_ParseTuple(args, "y*nnKKKKK|i", &recs, &k, &stop, &base, &p0, &n, &cursor, &max_len, &threads))
        return NULL;
    if (!valid(&recs, k, stop, cursor, p0, n, "scatter")) return NULL;
    job_t j = {(const rec_t *)recs.buf, k, stop, (const unsigned char *)(uintptr_t)base, p0, p0 + n, cursor,
               max_len, 0, 0, 0};
    Py_BEGIN_ALLOW_THREADS
    run_split(&j, threads);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&recs);
    return Py_BuildValue("nKiKK", j.k, (unsigned long long)j.cursor, j.err, (unsigned long long)j.ga,
                         (unsigned long long)j.gb);
}

PyDoc_STRVAR(
    gather_doc,
    "gather(recs, k, stop, base, p0, n, cursor, max_len, hash, /) -> (k, cursor)\n--\n\n"
    "Pack tensors into a piece of a blob being written: bytes [p0, p0 + n) of the blob, at address\n"
    "``base``. ``recs`` (writable) holds 4 uint64 per tensor (offset, length, checksum, source), in\n"
    "blob order. From record ``k`` on (not past ``stop``), for every tensor wholly inside the piece,\n"
    "at most ``max_len`` bytes long and with a source: zero the bytes between ``cursor`` and its\n"
    "offset, copy it in from its source, and (if ``hash``) store its checksum in the record. Stops at\n"
    "the first tensor that does not qualify. Returns the next record and the new cursor.");

static PyObject *gather(PyObject *self, PyObject *args) {
    Py_buffer recs;
    Py_ssize_t k, stop;
    unsigned long long base, p0, n, cursor, max_len;
    int hash;
    if (!need_hash()) return NULL;
    if (!PyArg_ParseTuple(args, "w*nnKKKKKp", &recs, &k, &stop, &base, &p0, &n, &cursor, &max_len, &hash))
        return NULL;
    if (!valid(&recs, k, stop, cursor, p0, n, "gather")) return NULL;
    rec_t *r = (rec_t *)recs.buf;
    const uint64_t p1 = p0 + n;
    unsigned char *piece = (unsigned char *)(uintptr_t)base;
    Py_BEGIN_ALLOW_THREADS
    for (; k < stop; k++) {
        const uint64_t o = r[k].off, len = r[k].len, e = o + len;
        if (o < p0 || e > p1 || len > max_len || r[k].dst == 0) break;
        if (o > cursor) memset(piece + (cursor - p0), 0, (size_t)(o - cursor));
        memcpy(piece + (o - p0), (const void *)(uintptr_t)r[k].dst, (size_t)len);
        if (hash) r[k].sum = xxh3(piece + (o - p0), (size_t)len);
        cursor = e;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&recs);
    return Py_BuildValue("nK", k, (unsigned long long)cursor);
}

PyDoc_STRVAR(hash_into_doc,
             "hash_into(recs, k, stop, base, /)\n--\n\n"
             "Store in records [k, stop) of ``recs`` (writable) the checksum of each tensor's bytes, found\n"
             "at ``base`` + its offset (GIL released).");

static PyObject *hash_into(PyObject *self, PyObject *args) {
    Py_buffer recs;
    Py_ssize_t k, stop;
    unsigned long long base;
    if (!need_hash()) return NULL;
    if (!PyArg_ParseTuple(args, "w*nnK", &recs, &k, &stop, &base)) return NULL;
    if (!valid(&recs, k, stop, 0, 0, 0, "hash_into")) return NULL;
    rec_t *r = (rec_t *)recs.buf;
    const unsigned char *b = (const unsigned char *)(uintptr_t)base;
    Py_BEGIN_ALLOW_THREADS
    for (; k < stop; k++) r[k].sum = xxh3(b + r[k].off, (size_t)r[k].len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&recs);
    Py_RETURN_NONE;
}

/* Byte planes of a compressed frame (tierckpt/format/codec.py, docs/format.md "Compressed copies"):
 * plane p of m elements of w bytes holds byte p of every element, at d + p * m. With SSE2, 16
 * elements at a time: splitting two vectors into their even and odd bytes (split2) once per factor of
 * 2 in w separates the planes, and interleaving (join2) undoes it; the rest one byte at a time.
 * On 4 MiB frames (best of 50, a shared 2-core machine): numpy's strided copies 2.1-2.9 GB/s, these
 * 6.5-8 GB/s splitting and 3.6-7.5 GB/s joining. */
static void shuffle_tail(const unsigned char *s, unsigned char *d, size_t i, size_t m, int w) {
    for (; i < m; i++)
        for (int p = 0; p < w; p++) d[(size_t)p * m + i] = s[i * w + p];
}

static void unshuffle_tail(const unsigned char *const *pl, unsigned char *d, size_t i, size_t m, int w) {
    for (; i < m; i++)
        for (int p = 0; p < w; p++) d[i * w + p] = pl[p][i];
}

#if defined(__SSE2__)
static inline void split2(__m128i x, __m128i y, __m128i *even, __m128i *odd) {
    const __m128i low = _mm_set1_epi16(0x00FF);
    *even = _mm_packus_epi16(_mm_and_si128(x, low), _mm_and_si128(y, low));
    *odd = _mm_packus_epi16(_mm_srli_epi16(x, 8), _mm_srli_epi16(y, 8));
}

static inline void join2(__m128i even, __m128i odd, __m128i *x, __m128i *y) {
    *x = _mm_unpacklo_epi8(even, odd);
    *y = _mm_unpackhi_epi8(even, odd);
}

/* 16 elements of 4 bytes in v[0..3] -> their 4 planes of 16 bytes (and back). */
static inline void split4(const __m128i *v, __m128i *pl) {
    __m128i e01, o01, e23, o23;
    split2(v[0], v[1], &e01, &o01);
    split2(v[2], v[3], &e23, &o23);
    split2(e01, e23, &pl[0], &pl[2]);
    split2(o01, o23, &pl[1], &pl[3]);
}

static inline void join4(const __m128i *pl, __m128i *v) {
    __m128i e01, o01, e23, o23;
    join2(pl[0], pl[2], &e01, &e23);
    join2(pl[1], pl[3], &o01, &o23);
    join2(e01, o01, &v[0], &v[1]);
    join2(e23, o23, &v[2], &v[3]);
}

static size_t shuffle_sse2(const unsigned char *s, unsigned char *d, size_t m, int w) {
    size_t i = 0;
    for (; i + 16 <= m; i += 16) {
        __m128i v[8], pl[8];
        for (int k = 0; k < w; k++) v[k] = _mm_loadu_si128((const __m128i *)(s + i * w + 16 * k));
        if (w == 2) {
            split2(v[0], v[1], &pl[0], &pl[1]);
        } else if (w == 4) {
            split4(v, pl);
        } else { /* 8: the even bytes are elements of 4 (bytes 0, 2, 4, 6), the odd ones too */
            __m128i e[4], o[4], pe[4], po[4];
            for (int k = 0; k < 4; k++) split2(v[2 * k], v[2 * k + 1], &e[k], &o[k]);
            split4(e, pe);
            split4(o, po);
            for (int q = 0; q < 4; q++) pl[2 * q] = pe[q], pl[2 * q + 1] = po[q];
        }
        for (int p = 0; p < w; p++) _mm_storeu_si128((__m128i *)(d + (size_t)p * m + i), pl[p]);
    }
    return i;
}

static size_t unshuffle_sse2(const unsigned char *const *in, unsigned char *d, size_t m, int w) {
    size_t i = 0;
    for (; i + 16 <= m; i += 16) {
        __m128i v[8], pl[8];
        for (int p = 0; p < w; p++) pl[p] = _mm_loadu_si128((const __m128i *)(in[p] + i));
        if (w == 2) {
            join2(pl[0], pl[1], &v[0], &v[1]);
        } else if (w == 4) {
            join4(pl, v);
        } else {
            __m128i e[4], o[4], pe[4], po[4];
            for (int q = 0; q < 4; q++) pe[q] = pl[2 * q], po[q] = pl[2 * q + 1];
            join4(pe, e);
            join4(po, o);
            for (int k = 0; k < 4; k++) join2(e[k], o[k], &v[2 * k], &v[2 * k + 1]);
        }
        for (int k = 0; k < w; k++) _mm_storeu_si128((__m128i *)(d + i * w + 16 * k), v[k]);
    }
    return i;
}
#endif

static void shuffle_bytes(const unsigned char *s, unsigned char *d, size_t m, int w) {
    size_t i = 0;
#if defined(__SSE2__)
    i = shuffle_sse2(s, d, m, w);
#endif
    shuffle_tail(s, d, i, m, w);
}

static void unshuffle_bytes(const unsigned char *const *pl, unsigned char *d, size_t m, int w) {
    size_t i = 0;
#if defined(__SSE2__)
    i = unshuffle_sse2(pl, d, m, w);
#endif
    unshuffle_tail(pl, d, i, m, w);
}

PyDoc_STRVAR(shuffle_doc,
             "shuffle(src, dst, width, /)\n--\n\n"
             "Write the byte planes of ``src`` (bytes of ``width``-byte elements, ``width`` 2, 4 or 8) to\n"
             "``dst`` (writable, as long): plane p, byte p of every element, at ``p * len(src) / width``.\n"
             "The GIL is released.");

static int plane_width(int w) {
    if (w == 2 || w == 4 || w == 8) return 1;
    PyErr_Format(PyExc_ValueError, "width %d is not 2, 4 or 8", w);
    return 0;
}

static PyObject *shuffle(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    int w;
    if (!PyArg_ParseTuple(args, "y*w*i", &src, &dst, &w)) return NULL;
    PyObject *ret = NULL;
    if (!plane_width(w)) goto done;
    if (src.len != dst.len || src.len % w) {
        PyErr_Format(PyExc_ValueError, "shuffle: %zd bytes into %zd, width %d", src.len, dst.len, w);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    shuffle_bytes((const unsigned char *)src.buf, (unsigned char *)dst.buf, (size_t)(src.len / w), w);
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return ret;
}

PyDoc_STRVAR(unshuffle_doc,
             "unshuffle(planes, dst, /)\n--\n\n"
             "Interleave ``planes`` (a sequence of 2, 4 or 8 buffers of equal length) into ``dst`` (writable,\n"
             "their total length): the inverse of ``shuffle`` (the GIL is released).");

static PyObject *unshuffle(PyObject *self, PyObject *args) {
    PyObject *seq;
    Py_buffer dst, pb[8];
    const unsigned char *pl[8];
    if (!PyArg_ParseTuple(args, "Ow*", &seq, &dst)) return NULL;
    PyObject *ret = NULL, *fast = PySequence_Fast(seq, "unshuffle: planes must be a sequence");
    Py_ssize_t w = fast ? PySequence_Fast_GET_SIZE(fast) : 0, got = 0;
    if (!fast || !plane_width((int)(w > 8 ? 0 : w))) goto done;
    for (; got < w; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, got), &pb[got], PyBUF_SIMPLE) < 0) goto done;
        pl[got] = (const unsigned char *)pb[got].buf;
        if (pb[got].len * w != dst.len) {
            PyErr_Format(PyExc_ValueError, "unshuffle: plane %zd is %zd bytes, dst %zd", got, pb[got].len, dst.len);
            got++;
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    unshuffle_bytes(pl, (unsigned char *)dst.buf, (size_t)(dst.len / w), (int)w);
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    while (got > 0) PyBuffer_Release(&pb[--got]);
    Py_XDECREF(fast);
    PyBuffer_Release(&dst);
    return ret;
}

static PyMethodDef methods[] = {
    {"set_hash", set_hash, METH_O, set_hash_doc},
    {"digest", digest, METH_VARARGS, digest_doc},
    {"is_zero", is_zero, METH_VARARGS, is_zero_doc},
    {"scatter", scatter, METH_VARARGS, scatter_doc},
    {"gather", gather, METH_VARARGS, gather_doc},
    {"hash_into", hash_into, METH_VARARGS, hash_into_doc},
    {"shuffle", shuffle, METH_VARARGS, shuffle_doc},
    {"unshuffle", unshuffle, METH_VARARGS, unshuffle_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tierckpt.format._native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
