/* redis_fixtures.h — real Redis servers for the G4 tests and the remote bench: started on loopback
 * (127.0.0.1 only) on free ports, each in its own temp directory, and always stopped: by rf_stop, by
 * the exit handler, by the watchdog (rf_watchdog), and by the kernel when this process dies
 * (PR_SET_PDEATHSIG). Needs hiredis (admin commands) and POSIX; independent of kvtest.h. */
#ifndef KVO_REDIS_FIXTURES_H
#define KVO_REDIS_FIXTURES_H
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <hiredis/hiredis.h>

#define RF_MAX_SERVERS 16

typedef struct rf_server {
    pid_t pid;
    int port, bus_port;
    char dir[64];
} rf_server;

static volatile pid_t rf__pids[RF_MAX_SERVERS];

static inline void rf__track(pid_t pid, int add)
{
    for (int i = 0; i < RF_MAX_SERVERS; i++)
        if (add ? rf__pids[i] == 0 : rf__pids[i] == pid) {
            rf__pids[i] = add ? pid : 0;
            return;
        }
}

static inline void rf_kill_all(void)
{
    for (int i = 0; i < RF_MAX_SERVERS; i++)
        if (rf__pids[i] > 0) kill(rf__pids[i], SIGKILL);
}

static inline void rf__watchdog_fired(int sig)
{
    static const char msg[] = "watchdog: the redis test hung; servers killed, giving up\n";
    ssize_t r;
    (void)sig;
    rf_kill_all();
    r = write(2, msg, sizeof msg - 1);
    (void)r;
    _exit(3);
}

/* After `seconds` every server is killed and the program exits (run.sh then reports it). */
static inline void rf_watchdog(unsigned seconds)
{
    static int registered;
    signal(SIGALRM, rf__watchdog_fired);
    alarm(seconds);
    if (!registered) {
        atexit(rf_kill_all);
        registered = 1;
    }
}

static inline uint64_t rf_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static inline void rf_sleep_ms(unsigned ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Full path of a program found on PATH (or the Debian locations), in buf; 0 when missing. */
static inline int rf_which(const char *name, char *buf, size_t size)
{
    const char *path = getenv("PATH");
    char dirs[4096];
    snprintf(dirs, sizeof dirs, "%s:/usr/bin:/usr/sbin:/usr/local/bin", path ? path : "");
    for (char *save = NULL, *d = strtok_r(dirs, ":", &save); d; d = strtok_r(NULL, ":", &save)) {
        snprintf(buf, size, "%s/%s", d, name);
        if (access(buf, X_OK) == 0) return 1;
    }
    return 0;
}

static inline int rf_have_redis(void)
{
    char p[512];
    return rf_which("redis-server", p, sizeof p) && rf_which("redis-cli", p, sizeof p);
}

/* A port nothing listens on now (the kernel picks one; cluster nodes get their bus port the same way). */
static inline int rf_free_port(void)
{
    for (int tries = 0; tries < 64; tries++) {
        struct sockaddr_in a;
        socklen_t len = sizeof a;
        int fd = socket(AF_INET, SOCK_STREAM, 0), port = 0;
        if (fd < 0) return 0;
        memset(&a, 0, sizeof a);
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &len) == 0)
            port = ntohs(a.sin_port);
        close(fd);
        if (port > 0) return port;
    }
    return 0;
}

/* Runs a program (argv[0] found on PATH) with stdout and stderr to `log` (NULL: /dev/null); waits at
 * most timeout_ms. Its exit status, or -1. */
static inline int rf_run(const char *const *argv, const char *log, unsigned timeout_ms)
{
    char prog[512];
    pid_t pid;
    int status = 0;
    uint64_t end = rf_now_us() + (uint64_t)timeout_ms * 1000u;
    if (!rf_which(argv[0], prog, sizeof prog)) return -1;
    pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        int fd = open(log ? log : "/dev/null", O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        execv(prog, (char *const *)(uintptr_t)argv);
        _exit(127);
    }
    rf__track(pid, 1);
    for (;;) {
        pid_t w = waitpid(pid, &status, WNOHANG);
        if (w == pid) break;
        if (w < 0 && errno != EINTR) {
            rf__track(pid, 0);
            return -1;
        }
        if (rf_now_us() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            rf__track(pid, 0);
            return -1;
        }
        rf_sleep_ms(5);
    }
    rf__track(pid, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* An admin connection (loopback), AUTHed when password is given; NULL on failure. */
static inline redisContext *rf_connect(int port, const char *password)
{
    struct timeval tv = {1, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (!c || c->err) {
        if (c) redisFree(c);
        return NULL;
    }
    redisSetTimeout(c, (struct timeval){10, 0});
    if (password) {
        redisReply *r = (redisReply *)redisCommand(c, "AUTH %s", password);
        int ok = r && r->type != REDIS_REPLY_ERROR;
        if (r) freeReplyObject(r);
        if (!ok) {
            redisFree(c);
            return NULL;
        }
    }
    return c;
}

/* One admin command (printf-style, hiredis formats); the reply (free it), or NULL. */
static inline redisReply *rf_cmd(int port, const char *password, const char *fmt, ...)
{
    redisContext *c = rf_connect(port, password);
    redisReply *r = NULL;
    va_list ap;
    if (!c) return NULL;
    va_start(ap, fmt);
    r = (redisReply *)redisvCommand(c, fmt, ap);
    va_end(ap);
    redisFree(c);
    return r;
}

/* Integer reply of a command (printf-style, as rf_cmd), -1 on anything else. */
static inline long long rf_int(int port, const char *password, const char *fmt, ...)
{
    redisContext *c = rf_connect(port, password);
    redisReply *r = NULL;
    long long v;
    va_list ap;
    if (!c) return -1;
    va_start(ap, fmt);
    r = (redisReply *)redisvCommand(c, fmt, ap);
    va_end(ap);
    redisFree(c);
    v = r && r->type == REDIS_REPLY_INTEGER ? r->integer : -1;
    if (r) freeReplyObject(r);
    return v;
}

/* Starts redis-server on 127.0.0.1:port (0 = a free one) in a fresh temp directory with the extra
 * arguments (NULL-terminated; may be NULL), and waits until it answers. 1 on success. */
static inline int rf_start_on(rf_server *s, int port, int cluster, const char *const *extra)
{
    char prog[512], portbuf[16], busbuf[16], logfile[128];
    const char *argv[64];
    int argc = 0, tries;
    if (!rf_which("redis-server", prog, sizeof prog)) return 0;
    if (!s->dir[0]) {
        snprintf(s->dir, sizeof s->dir, "/tmp/kvredis-XXXXXX");
        if (!mkdtemp(s->dir)) {
            s->dir[0] = 0;
            return 0;
        }
    }
    for (tries = 0; tries < 5; tries++) {
        s->port = port ? port : rf_free_port();
        s->bus_port = cluster ? rf_free_port() : 0;
        if (cluster && s->bus_port == s->port) continue;
        snprintf(portbuf, sizeof portbuf, "%d", s->port);
        snprintf(busbuf, sizeof busbuf, "%d", s->bus_port);
        snprintf(logfile, sizeof logfile, "%s/redis.log", s->dir);
        argc = 0;
        argv[argc++] = prog;
        argv[argc++] = "--port";
        argv[argc++] = portbuf;
        argv[argc++] = "--bind";
        argv[argc++] = "127.0.0.1";
        argv[argc++] = "--dir";
        argv[argc++] = s->dir;
        argv[argc++] = "--logfile";
        argv[argc++] = logfile;
        argv[argc++] = "--save";
        argv[argc++] = "";
        argv[argc++] = "--appendonly";
        argv[argc++] = "no";
        argv[argc++] = "--daemonize";
        argv[argc++] = "no";
        argv[argc++] = "--maxmemory";
        argv[argc++] = "1gb";
        argv[argc++] = "--maxmemory-policy";
        argv[argc++] = "allkeys-lru";
        if (cluster) {
            argv[argc++] = "--cluster-enabled";
            argv[argc++] = "yes";
            argv[argc++] = "--cluster-port";
            argv[argc++] = busbuf;
            argv[argc++] = "--cluster-config-file";
            argv[argc++] = "nodes.conf";
            argv[argc++] = "--cluster-node-timeout";
            argv[argc++] = "5000";
        }
        for (int i = 0; extra && extra[i] && argc < 62; i++) argv[argc++] = extra[i];
        argv[argc] = NULL;
        s->pid = fork();
        if (s->pid < 0) return 0;
        if (s->pid == 0) {
            int fd = open("/dev/null", O_WRONLY);
            if (fd >= 0) {
                dup2(fd, 1);
                dup2(fd, 2);
                close(fd);
            }
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            execv(prog, (char *const *)(uintptr_t)argv);
            _exit(127);
        }
        rf__track(s->pid, 1);
        /* ready when it answers anything (NOAUTH included) */
        for (uint64_t end = rf_now_us() + 5000000; rf_now_us() < end;) {
            int status;
            redisContext *c;
            if (waitpid(s->pid, &status, WNOHANG) == s->pid) { /* died: port taken? try another */
                rf__track(s->pid, 0);
                s->pid = 0;
                break;
            }
            c = rf_connect(s->port, NULL);
            if (c) {
                redisReply *r = (redisReply *)redisCommand(c, "PING");
                int ok = r != NULL;
                if (r) freeReplyObject(r);
                redisFree(c);
                if (ok) return 1;
            }
            rf_sleep_ms(10);
        }
        if (s->pid > 0) {
            kill(s->pid, SIGKILL);
            waitpid(s->pid, NULL, 0);
            rf__track(s->pid, 0);
            s->pid = 0;
        }
        if (port) rf_sleep_ms(100); /* a fixed port: it may still be held a moment */
    }
    return 0;
}

static inline int rf_start(rf_server *s, const char *const *extra)
{
    memset(s, 0, sizeof *s);
    return rf_start_on(s, 0, 0, extra);
}

/* Kill the server (SIGKILL: no clean shutdown, like a crash); its directory stays for a restart. */
static inline void rf_kill(rf_server *s)
{
    if (s->pid > 0) {
        kill(s->pid, SIGKILL);
        waitpid(s->pid, NULL, 0);
        rf__track(s->pid, 0);
    }
    s->pid = 0;
}

/* Kill it and remove its directory. */
static inline void rf_stop(rf_server *s)
{
    char cmd[128];
    rf_kill(s);
    if (s->dir[0] && !strncmp(s->dir, "/tmp/kvredis-", 13)) {
        const char *files[] = {"redis.log", "nodes.conf", "dump.rdb", "rf.log"};
        for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
            snprintf(cmd, sizeof cmd, "%s/%s", s->dir, files[i]);
            unlink(cmd);
        }
        rmdir(s->dir);
    }
    s->dir[0] = 0;
}

/* Three started cluster nodes (rf_start_on with cluster = 1) joined into one cluster covering every
 * slot (redis-cli --cluster create). 1 when every node says cluster_state:ok. */
static inline int rf_cluster_create(rf_server nodes[3])
{
    char a[3][32];
    const char *argv[12];
    int argc = 0, ok = 0;
    for (int i = 0; i < 3; i++) snprintf(a[i], sizeof a[i], "127.0.0.1:%d", nodes[i].port);
    argv[argc++] = "redis-cli";
    argv[argc++] = "--cluster";
    argv[argc++] = "create";
    for (int i = 0; i < 3; i++) argv[argc++] = a[i];
    argv[argc++] = "--cluster-replicas";
    argv[argc++] = "0";
    argv[argc++] = "--cluster-yes";
    argv[argc] = NULL;
    if (rf_run(argv, NULL, 20000) != 0) return 0;
    for (uint64_t end = rf_now_us() + 10000000; rf_now_us() < end && !ok;) {
        ok = 1;
        for (int i = 0; i < 3 && ok; i++) {
            redisReply *r = rf_cmd(nodes[i].port, NULL, "CLUSTER INFO");
            ok = r && r->type == REDIS_REPLY_STRING && strstr(r->str, "cluster_state:ok");
            if (r) freeReplyObject(r);
        }
        if (!ok) rf_sleep_ms(50);
    }
    return ok;
}

/* Three cluster nodes started and joined (rf_cluster_create). 1 when the cluster is up. */
static inline int rf_cluster_start(rf_server nodes[3])
{
    for (int i = 0; i < 3; i++) {
        memset(&nodes[i], 0, sizeof nodes[i]);
        if (!rf_start_on(&nodes[i], 0, 1, NULL)) return 0;
    }
    return rf_cluster_create(nodes);
}

#endif
