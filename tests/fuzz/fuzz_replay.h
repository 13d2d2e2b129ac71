/* fuzz_replay.h — replay without libFuzzer (make test), shared by the fuzz targets: each file named on
 * the command line, or every file of KVFUZZ_CORPUS (defined by the target before including this),
 * runs once through LLVMFuzzerTestOneInput; one line per file and kvtest.h's summary line. */
#ifndef KVFUZZ_REPLAY_H
#define KVFUZZ_REPLAY_H
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fz_replay(const char *path)
{
    FILE *fp = fopen(path, "rb");
    static uint8_t buf[1 << 20];
    size_t n;
    if (!fp) {
        printf("FAIL %s: cannot open\n", path);
        return 0;
    }
    n = fread(buf, 1, sizeof buf, fp);
    fclose(fp);
    LLVMFuzzerTestOneInput(buf, n); /* aborts on a failed check: run.sh then counts the program failed */
    printf("ok   %s (%zu bytes)\n", path, n);
    fflush(stdout);
    return 1;
}

static int fz_cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

int main(int argc, char **argv)
{
    int passed = 0, failed = 0;
    if (argc > 1) {
        for (int i = 1; i < argc; i++) {
            if (fz_replay(argv[i])) passed++;
            else failed++;
        }
    } else {
        DIR *d = opendir(KVFUZZ_CORPUS);
        struct dirent *e;
        char **names = NULL;
        size_t n = 0, cap = 0;
        if (!d) {
            printf("FAIL cannot open %s\n", KVFUZZ_CORPUS);
            return 1;
        }
        while ((e = readdir(d)) != NULL) {
            if (e->d_name[0] == '.') continue;
            if (n == cap) {
                char **more = (char **)realloc(names, (cap = cap ? cap * 2 : 64) * sizeof *names);
                if (!more) return 1;
                names = more;
            }
            names[n] = (char *)malloc(strlen(KVFUZZ_CORPUS) + strlen(e->d_name) + 2);
            if (!names[n]) return 1;
            sprintf(names[n], "%s/%s", KVFUZZ_CORPUS, e->d_name);
            n++;
        }
        closedir(d);
        qsort(names, n, sizeof *names, fz_cmp);
        for (size_t i = 0; i < n; i++) {
            if (fz_replay(names[i])) passed++;
            else failed++;
            free(names[i]);
        }
        free(names);
        if (!n) {
            printf("FAIL %s holds no inputs\n", KVFUZZ_CORPUS);
            failed++;
        }
    }
    printf("%d passed, %d failed, 0 skipped\n", passed, failed);
    return failed ? 1 : 0;
}
#endif
