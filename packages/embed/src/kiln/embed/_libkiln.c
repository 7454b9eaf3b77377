/* libkiln: the C functions of kiln.h. Each starts the embedded interpreter once (in the environment
 * of KILN_PYTHON, defined by the build), then calls its Python side, kiln_py_* (kiln/embed/_cabi.py),
 * which returns the status. cffi would return 0 from a Python function whose interpreter failed to
 * start, so the start is checked here and reported as KILN_ERR_INIT. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

#define KILN_EXPORT __attribute__((visibility("default")))

/* the functions of _cabi.py, which cffi defines below (ffi.embedding_api) */
int kiln_py_version(char *, size_t, size_t *);
int kiln_py_compile(const char *, kiln_program *);
int kiln_py_plan(kiln_program, char *, size_t, size_t *);
int kiln_py_arena_bytes(kiln_program, size_t *);
int kiln_py_bind(kiln_program, void *, size_t);
int kiln_py_train_step(kiln_program, const int32_t *, const int32_t *, size_t, kiln_step_stats *);
int kiln_py_get_tensor(kiln_program, const char *, void *, size_t);
int kiln_py_set_tensor(kiln_program, const char *, const void *, size_t);
int kiln_py_free(kiln_program);

static _Thread_local char *kiln_error = NULL;
static pthread_once_t kiln_once = PTHREAD_ONCE_INIT;
static int kiln_status = KILN_ERR_INIT;
static char kiln_init_error[4096];

/* Called by _cabi.py (and below) with the JSON of the calling thread's error. */
static void kiln_store_error(const char *json)
{
    free(kiln_error);
    kiln_error = strdup(json);
}

/* {"code": "init", "message": <what, then detail>, "culprit": "libkiln"}, escaped for JSON. */
static void kiln_fail_init(const char *what, const char *detail)
{
    char message[3000];
    size_t n = 0;
    snprintf(message, sizeof message, "%s%s", what, detail ? detail : "");
    n += snprintf(kiln_init_error, sizeof kiln_init_error, "{\"code\": \"init\", \"message\": \"");
    for (const char *c = message; *c && n + 8 < sizeof kiln_init_error - 40; c++) {
        if (*c == '"' || *c == '\\')
            n += snprintf(kiln_init_error + n, sizeof kiln_init_error - n, "\\%c", *c);
        else if ((unsigned char)*c < 0x20)
            n += snprintf(kiln_init_error + n, sizeof kiln_init_error - n, "\\u%04x", *c);
        else
            kiln_init_error[n++] = *c;
    }
    snprintf(kiln_init_error + n, sizeof kiln_init_error - n, "\", \"culprit\": \"libkiln\"}");
}

/* Import a module the start needs; on failure, record the Python error. Holds the GIL. */
static int kiln_import(const char *name)
{
    PyObject *module = PyImport_ImportModule(name);
    if (module != NULL) {
        Py_DECREF(module);
        return 1;
    }
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyObject *text = value ? PyObject_Str(value) : NULL;
    const char *detail = text ? PyUnicode_AsUTF8(text) : NULL;
    char what[256];
    snprintf(what, sizeof what, "the embedded Python (%s) cannot import %s: %s: ", KILN_PYTHON, name,
             type ? ((PyTypeObject *)type)->tp_name : "error");
    kiln_fail_init(what, detail);
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(trace);
    PyErr_Clear();
    return 0;
}

static void kiln_start(void)
{
    if (!Py_IsInitialized()) {
        /* isolated: no PYTHON* variables, no user site, the host's signal handlers stay; the executable
           makes sys.path the one of its environment (a venv's pyvenv.cfg is read) */
        PyConfig config;
        PyConfig_InitIsolatedConfig(&config);
        PyStatus status = PyConfig_SetBytesString(&config, &config.executable, KILN_PYTHON);
        if (!PyStatus_Exception(status))
            status = Py_InitializeFromConfig(&config);
        PyConfig_Clear(&config);
        if (PyStatus_Exception(status)) {
            kiln_fail_init("the embedded Python did not start: ", status.err_msg);
            return;
        }
        PyEval_SaveThread();
    }
    PyGILState_STATE gil = PyGILState_Ensure();
    int ok = kiln_import("_cffi_backend") && kiln_import("kiln.embed._cabi");
    PyGILState_Release(gil);
    if (!ok)
        return;
    if (cffi_start_python() != 0) {
        kiln_fail_init("libkiln's init code failed; its traceback is on stderr", NULL);
        return;
    }
    kiln_status = KILN_OK;
}

#define KILN_START()                                                                                 \
    do {                                                                                             \
        pthread_once(&kiln_once, kiln_start);                                                        \
        if (kiln_status != KILN_OK) {                                                                \
            kiln_store_error(kiln_init_error);                                                       \
            return KILN_ERR_INIT;                                                                    \
        }                                                                                            \
    } while (0)

KILN_EXPORT int kiln_last_error(char *buf, size_t cap, size_t *needed)
{
    const char *text = kiln_error ? kiln_error : "";
    size_t size = strlen(text) + 1;
    if (needed)
        *needed = size;
    if (buf == NULL)
        return KILN_OK;
    if (cap < size)
        return KILN_ERR_SIZE;
    memcpy(buf, text, size);
    return KILN_OK;
}

KILN_EXPORT int kiln_version(char *buf, size_t cap, size_t *needed)
{
    KILN_START();
    return kiln_py_version(buf, cap, needed);
}

KILN_EXPORT int kiln_compile(const char *spec_json, kiln_program *out)
{
    KILN_START();
    return kiln_py_compile(spec_json, out);
}

KILN_EXPORT int kiln_plan(kiln_program program, char *buf, size_t cap, size_t *needed)
{
    KILN_START();
    return kiln_py_plan(program, buf, cap, needed);
}

KILN_EXPORT int kiln_arena_bytes(kiln_program program, size_t *out)
{
    KILN_START();
    return kiln_py_arena_bytes(program, out);
}

KILN_EXPORT int kiln_bind(kiln_program program, void *buffer, size_t nbytes)
{
    KILN_START();
    return kiln_py_bind(program, buffer, nbytes);
}

KILN_EXPORT int kiln_train_step(kiln_program program, const int32_t *input_ids, const int32_t *labels,
                                size_t count, kiln_step_stats *stats)
{
    KILN_START();
    return kiln_py_train_step(program, input_ids, labels, count, stats);
}

KILN_EXPORT int kiln_get_tensor(kiln_program program, const char *name, void *dst, size_t nbytes)
{
    KILN_START();
    return kiln_py_get_tensor(program, name, dst, nbytes);
}

KILN_EXPORT int kiln_set_tensor(kiln_program program, const char *name, const void *src, size_t nbytes)
{
    KILN_START();
    return kiln_py_set_tensor(program, name, src, nbytes);
}

KILN_EXPORT int kiln_free(kiln_program program)
{
    KILN_START();
    return kiln_py_free(program);
}
