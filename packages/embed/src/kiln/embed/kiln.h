/* kiln.h: the C ABI of libkiln, kiln's training compiler inside a C, C++ or Rust host.
 *
 * Every function returns a status: KILN_OK (0) or one of KILN_ERR_*; on an error, kiln_last_error
 * gives {"code", "message", "culprit"} as JSON for the calling thread. The first call starts a
 * Python interpreter inside the process, in the environment that built the library; when that
 * fails, every call returns KILN_ERR_INIT.
 *
 * Threads: any thread may call; calls run one at a time (libkiln holds one lock for each call).
 * A bound buffer belongs to kiln while a call on its program runs, and must stay alive until the
 * program is freed or bound elsewhere. See docs/embedding.md.
 */
#ifndef KILN_H
#define KILN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KILN_ABI_VERSION 1

enum {
    KILN_OK = 0,
    KILN_ERR_INIT = 1,      /* the embedded interpreter or kiln failed to start */
    KILN_ERR_JSON = 2,      /* text that is not valid JSON */
    KILN_ERR_ARGUMENT = 3,  /* a NULL pointer, a bad spec key, an unaligned buffer, a token id out of range */
    KILN_ERR_HANDLE = 4,    /* a program handle that is unknown or freed */
    KILN_ERR_TENSOR = 5,    /* a tensor name the program does not have */
    KILN_ERR_SIZE = 6,      /* a byte count or buffer that does not fit; *needed says what does */
    KILN_ERR_MODEL = 7,     /* kiln rejected the model or its options (the message is kiln's) */
    KILN_ERR_INTERNAL = 8   /* a bug in kiln: please report the message */
};

typedef uint64_t kiln_program;  /* 0 is never a valid handle */

typedef struct {
    double loss;       /* mean loss over the positions not ignored */
    double grad_norm;  /* global gradient norm before clipping */
    double lr;         /* learning rate of this update */
    int64_t step;      /* updates so far */
    int64_t tokens;    /* positions not ignored */
} kiln_step_stats;

/* Text out: writes a NUL-terminated string to buf when cap is large enough, and always sets
 * *needed (may be NULL) to its size including the NUL; buf == NULL asks for the size only. */

/* {"abi": 1, "kiln-embed": "...", "kiln-core": "...", "python": "...", "prefix": "..."} */
int kiln_version(char *buf, size_t cap, size_t *needed);

/* The last error of this thread as JSON: {"code", "message", "culprit"}, or "" when none. */
int kiln_last_error(char *buf, size_t cap, size_t *needed);

/* Compile a spec (JSON object): {"model": "Qwen3Model", "config": {...}} or {"ir": {...}}, with
 * "batch", "seq" and optionally "seed", "optimizer", "recompute", "dtype", "mode". */
int kiln_compile(const char *spec_json, kiln_program *out);

/* The plan as JSON: arena_bytes, parameters, tensors (shape, dtype, offset, nbytes), phases, memory. */
int kiln_plan(kiln_program program, char *buf, size_t cap, size_t *needed);

int kiln_arena_bytes(kiln_program program, size_t *out);

/* Run in host memory: at least kiln_arena_bytes, 64-byte aligned (aligned_alloc(64, ...)). Weights
 * and optimizer state move there; tensor t lives at buffer + plan.tensors[t].offset. */
int kiln_bind(kiln_program program, void *buffer, size_t nbytes);

/* One training step on batch x seq int32 token ids and labels (the next tokens; -100 is ignored);
 * count is batch * seq. stats may be NULL. */
int kiln_train_step(kiln_program program, const int32_t *input_ids, const int32_t *labels, size_t count,
                    kiln_step_stats *stats);

/* Copy a tensor out or in by name; nbytes must equal the tensor's bytes (plan.tensors[name].nbytes). */
int kiln_get_tensor(kiln_program program, const char *name, void *dst, size_t nbytes);
int kiln_set_tensor(kiln_program program, const char *name, const void *src, size_t nbytes);

int kiln_free(kiln_program program);

#ifdef __cplusplus
}
#endif

#endif /* KILN_H */
