/* Feeds libkiln bad input, one case per line of output: "case|status|last error JSON". A crash, or a
 * program that stops working after the errors, fails the test that runs this. argv[1]: a valid spec. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

static void report(const char *name, int status)
{
    char error[8192] = "";
    if (status != KILN_OK)
        kiln_last_error(error, sizeof error, NULL);
    printf("%s|%d|%s\n", name, status, error);
}

int main(int argc, char **argv)
{
    if (argc != 2)
        return 2;
    kiln_program p = 0, freed = 0;
    size_t n = 0, needed = 0;
    char small[4];
    int32_t ids[16] = {0}, labels[16] = {0};

    report("json", kiln_compile("{\"model\": \"Qwen3Model\", batch: 2", &p));
    report("spec_null", kiln_compile(NULL, &p));
    report("out_null", kiln_compile(argv[1], NULL));
    report("not_object", kiln_compile("[1, 2]", &p));
    report("unknown_model", kiln_compile("{\"model\": \"NoSuchModel\", \"batch\": 2, \"seq\": 8}", &p));
    report("bad_batch", kiln_compile("{\"model\": \"Qwen3Model\", \"batch\": -1, \"seq\": 8}", &p));
    report("unknown_key", kiln_compile("{\"model\": \"Qwen3Model\", \"batch\": 2, \"seq\": 8, \"lr\": 1}", &p));
    report("bad_ir", kiln_compile("{\"ir\": {\"kiln_ir\": 1, \"modules\": 7}, \"batch\": 2, \"seq\": 8}", &p));
    report("not_utf8", kiln_compile("\xff\xfe{}", &p));

    report("compile", kiln_compile(argv[1], &p));
    report("plan_small", kiln_plan(p, small, sizeof small, &needed));
    printf("plan_needed|%zu\n", needed);
    report("arena_null", kiln_arena_bytes(p, NULL));
    report("unknown_handle", kiln_arena_bytes(12345, &n));
    report("arena", kiln_arena_bytes(p, &n));
    char *arena = aligned_alloc(64, (n + 127) / 64 * 64);
    report("bind_small", kiln_bind(p, arena, 64));
    report("bind_unaligned", kiln_bind(p, arena + 1, n));
    report("bind_null", kiln_bind(p, NULL, n));
    report("step_count", kiln_train_step(p, ids, labels, 3, NULL));
    ids[5] = 100000;
    report("step_token", kiln_train_step(p, ids, labels, 16, NULL));
    ids[5] = 0;
    labels[2] = -7;
    report("step_label", kiln_train_step(p, ids, labels, 16, NULL));
    labels[2] = -100;
    report("step_null", kiln_train_step(p, NULL, labels, 16, NULL));
    report("tensor_unknown", kiln_get_tensor(p, "embeding", small, sizeof small));
    report("tensor_size", kiln_get_tensor(p, "embedding", small, sizeof small));
    report("tensor_src_null", kiln_set_tensor(p, "embedding", NULL, 64 * 32 * 4));
    report("tensor_name_null", kiln_set_tensor(p, NULL, small, sizeof small));

    /* still working after all of that: bound, one step, freed; then the handle is gone */
    report("bind", kiln_bind(p, arena, n));
    kiln_step_stats stats;
    report("step", kiln_train_step(p, ids, labels, 16, &stats));
    printf("loss|%a\n", stats.loss);
    freed = p;
    report("free", kiln_free(p));
    report("free_again", kiln_free(freed));
    report("step_freed", kiln_train_step(freed, ids, labels, 16, NULL));
    report("last_error_small", kiln_last_error(small, sizeof small, &needed));
    printf("error_needed|%zu\n", needed);
    free(arena);
    return 0;
}
