/* The argument handling both kernel modules share (_minhash.c, _pack.c): plain C-contiguous buffers taken from
   Python objects, checked for whole items, released on every path. Included once per extension. */
#ifndef SMOLCTL_BUFFERS_H
#define SMOLCTL_BUFFERS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

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

#endif
