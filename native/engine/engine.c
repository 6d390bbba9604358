/* The placement engine's hot path: which nodes can take a pod, how good each is,
 * which cards (see gpuslice_scheduler/engine.py for the rules in prose, and
 * engine_core.h for the interface).
 *
 * A node's answer depends on that node alone, so the work is one pass per node:
 *   1. each card gets a fit code, HAMi's rules in HAMi's order;
 *   2. fitting cards are ranked by the GPU policy's card score; under HAMi's
 *      policies (binpack, spread) equal cards rank as in HAMi's card list;
 *   3. the best `count` cards are taken (from one NUMA node when the pod binds
 *      NUMA) and added to a scratch copy of the node's usage, so that the pod's
 *      later containers see its earlier ones;
 *   4. a node that found cards for every container is scored by the node policy.
 *
 * Fragmentation follows FGD: for each class of the expected workload, the free
 * share of the cards it cannot use is a fragment, or all of the node's free
 * share when the node cannot host the class at all; classes are weighted.
 * To that it adds the free share the node's CPU or memory cannot feed: FGD asks
 * only whether one more pod fits, so a node whose CPU is nearly gone looks
 * sound until the last pod that fits has come, and its remaining cards are
 * lost then. Fed at the mix's own ratio of CPU (memory) to GPU share, a node
 * with C free CPU can use C / ratio of its free share; the rest is starved,
 * and weighs more than a fragment: it is lost to every pod to come, a fragment
 * only to those that cannot use it.
 * Sums run in card order, so results match the NumPy formulation to rounding. */
#include "engine_core.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum {
    FITS = 0,
    NOT_FOUND = 1,
    NOT_HEALTHY = 2,
    CORDONED = 3,
    TYPE_MISMATCH = 4,
    NUMA_NOT_FIT = 5,
    UUID_MISMATCH = 6,
    SLOTS_EXHAUSTED = 7,
    INSUFFICIENT_MEMORY = 8,
    INSUFFICIENT_CORE = 9,
    EXCLUSIVE_CONFLICT = 10,
    COMPUTE_EXHAUSTED = 11,
    MIG_TOPOLOGY_INFEASIBLE = 12,
    TOO_FEW_CARDS = 13,
    NODE_INSUFFICIENT_DEVICE = 14,
};

typedef struct {
    int64_t mem, cores, slots;
    uint8_t owned;
} usage_t;

/* Per-node aggregates of the fragmentation measure. */
typedef struct {
    int64_t *count;    /* per part: cards that could take one more of it */
    double *unusable;  /* per part: free share on cards it cannot use */
    uint8_t *usable;   /* (cards, parts) */
    double *share;     /* per card */
    double total;      /* free share of the node */
    double frag;
} fragments_t;

typedef struct {
    uint64_t group;
    double score;
    int64_t tie; /* among equal scores, the higher first */
    int64_t row;
} ranked_t;

/* The classes' weights as one node sees them, for its CPU and memory free: per
 * part p and number c of cards usable by it (0 to the node's card count), the
 * weight of the classes of part p the node hosts with c such cards, and of those
 * it does not. Built once per node, it prices a card in one pass over the parts
 * instead of one over the classes. */
typedef struct {
    double *hosted;   /* (parts, width) */
    double *stranded; /* (parts, width) */
    int64_t width;    /* cards of the node + 1 */
    int built;        /* for these: nodes alike in them share the tables */
    double cpu, mem;
} hosting_t;

typedef struct {
    usage_t *base, *now;
    int8_t *statics, *codes;
    int64_t *mem;
    int64_t *pos;   /* per row: its place in HAMi's card list (binpack, spread) */
    int64_t *order; /* per place in that list: its row */
    double *card_score, *card_frag, *card_total;
    ranked_t *ranked;
    fragments_t before, after, one;
    hosting_t host_before, host_after; /* with the node's CPU and memory free before, after */
} scratch_t;

static int64_t floor_div(int64_t a, int64_t b)
{
    int64_t q = a / b;
    if (a % b != 0 && ((a < 0) != (b < 0)))
        q--;
    return q;
}

static int64_t at_least_one(int64_t v)
{
    return v > 1 ? v : 1;
}

/* MiB a percentage of `cap` takes: rounded down, but never 0 (0 reads as no limit). */
static int64_t percent_of(int64_t cap, int64_t percent)
{
    return at_least_one(floor_div(cap * percent, 100));
}

static int schedulable(const gs_cluster_t *c, int64_t card)
{
    return c->present[card] && c->healthy[card] && !c->cordoned[card];
}

/* ---------------------------------------------------------------- fragmentation */

/* Could one more container of each part go on `card` with usage `u`. */
static void card_usable(const gs_cluster_t *c, const gs_mix_t *m, int64_t card,
                        const usage_t *u, uint8_t *out)
{
    const uint8_t *model_ok = m->model_ok + c->model_id[card] * m->parts;
    int sched = schedulable(c, card);
    int64_t cap_mem = c->cap_mem[card], cap_cores = c->cap_cores[card];
    int slots_full = u->slots >= c->cap_slots[card];
    for (int64_t p = 0; p < m->parts; p++) {
        if (!sched || !model_ok[p] || slots_full || u->owned) {
            out[p] = 0;
            continue;
        }
        int64_t need_mem = m->part_mem_mib[p] >= 0 ? m->part_mem_mib[p]
                                                   : percent_of(cap_mem, m->part_mem_percent[p]);
        int64_t cores = m->part_cores[p];
        int broken = need_mem > cap_mem - u->mem || cores > cap_cores - u->cores ||
                     (m->part_exclusive[p] && u->slots > 0) ||
                     (cores == 0 && u->cores >= cap_cores);
        out[p] = !broken;
    }
}

/* Free compute of a card in milli-GPU; 0 where it takes no new work. */
static double card_share(const gs_cluster_t *c, int64_t card, const usage_t *u)
{
    if (!schedulable(c, card) || u->owned)
        return 0.0;
    int64_t cap = c->cap_cores[card];
    int64_t free = cap - u->cores > 0 ? cap - u->cores : 0;
    return (double)free * 1000.0 / (double)at_least_one(cap);
}

static void hosting_build(const gs_mix_t *m, double cpu, double mem, int64_t k, hosting_t *h)
{
    int64_t width = k + 1, cells = m->parts * width;
    if (h->built && h->width == width && h->cpu == cpu && h->mem == mem)
        return;
    h->built = 1;
    h->cpu = cpu;
    h->mem = mem;
    h->width = width;
    for (int64_t i = 0; i < cells; i++)
        h->hosted[i] = h->stranded[i] = 0.0;
    /* first the weight that starts being hosted at each count, and each part's total */
    for (int64_t cl = 0; cl < m->classes; cl++) {
        int64_t row = m->part[cl] * width, need = m->need[cl];
        h->stranded[row] += m->weight[cl];
        if (cpu >= m->cpu[cl] && mem >= m->memory[cl] && need <= k)
            h->hosted[row + (need > 0 ? need : 0)] += m->weight[cl];
    }
    for (int64_t p = 0; p < m->parts; p++) {
        double *hosted = h->hosted + p * width, *stranded = h->stranded + p * width;
        double all = stranded[0];
        for (int64_t c = 0; c < width; c++) {
            if (c > 0)
                hosted[c] += hosted[c - 1];
            stranded[c] = all - hosted[c];
        }
    }
}

/* Free share (of `total`) that free CPU `cpu` and memory `mem` cannot feed at the
 * mix's ratios (0 where it has none): at most `total`, also for a node whose CPU
 * or memory is overcommitted. */
static double starved(const gs_mix_t *m, double total, double cpu, double mem)
{
    double out = 0.0;
    const double ratio[2] = {m->cpu_per_share, m->mem_per_share};
    const double have[2] = {cpu, mem};
    for (int i = 0; i < 2; i++) {
        if (!(ratio[i] > 0.0))
            continue;
        double unfed = total - (have[i] > 0.0 ? have[i] : 0.0) / ratio[i];
        if (unfed > out)
            out = unfed;
    }
    return out < total ? out : total;
}

/* A node's fragmentation: a class it hosts finds the free share of the cards it
 * cannot use stranded, one it does not host all of the node's free share; and
 * the share its CPU and memory cannot feed. */
static double mix_score(const gs_mix_t *m, const hosting_t *h, const int64_t *count,
                        const double *unusable, double total)
{
    double score = 0.0;
    for (int64_t p = 0; p < m->parts; p++) {
        int64_t c = count[p] < h->width ? count[p] : h->width - 1;
        if (c < 0)
            c = 0;
        score += unusable[p] * h->hosted[p * h->width + c] +
                 total * h->stranded[p * h->width + c];
    }
    return score + m->starved_weight * starved(m, total, h->cpu, h->mem);
}

/* Fragmentation of the node whose cards start at `first`, with usage `u`. */
static void node_fragments(const gs_cluster_t *c, const gs_mix_t *m, int64_t first, int64_t k,
                           const usage_t *u, const hosting_t *h, fragments_t *f)
{
    int64_t parts = m->parts;
    memset(f->count, 0, (size_t)parts * sizeof *f->count);
    for (int64_t p = 0; p < parts; p++)
        f->unusable[p] = 0.0;
    f->total = 0.0;
    for (int64_t j = 0; j < k; j++) {
        uint8_t *usable = f->usable + j * parts;
        card_usable(c, m, first + j, &u[j], usable);
        double share = card_share(c, first + j, &u[j]);
        f->share[j] = share;
        f->total += share;
        for (int64_t p = 0; p < parts; p++) {
            if (usable[p])
                f->count[p]++;
            else
                f->unusable[p] += share;
        }
    }
    f->frag = mix_score(m, h, f->count, f->unusable, f->total);
}

/* The node's fragmentation if card row `j` changed from `before`'s usage to `u`;
 * `one` is scratch for that card. Sets *total to the node's free share then. */
static double fragmentation_after(const gs_cluster_t *c, const gs_mix_t *m, int64_t first,
                                  int64_t j, const usage_t *u, const fragments_t *before,
                                  fragments_t *one, const hosting_t *h, double *total)
{
    int64_t parts = m->parts;
    const uint8_t *old_usable = before->usable + j * parts;
    double old_share = before->share[j];
    card_usable(c, m, first + j, u, one->usable);
    double new_share = card_share(c, first + j, u);
    for (int64_t p = 0; p < parts; p++) {
        one->count[p] = before->count[p] - old_usable[p] + one->usable[p];
        one->unusable[p] = before->unusable[p] - (old_usable[p] ? 0.0 : old_share) +
                           (one->usable[p] ? 0.0 : new_share);
    }
    *total = before->total - old_share + new_share;
    return mix_score(m, h, one->count, one->unusable, *total);
}

/* ---------------------------------------------------------------- fit */

static int8_t static_code(const gs_cluster_t *c, const gs_demand_t *d, int64_t card)
{
    if (!c->present[card])
        return NOT_FOUND;
    if (!c->healthy[card])
        return NOT_HEALTHY;
    if (c->cordoned[card])
        return CORDONED;
    if (d->type_ok && !d->type_ok[c->model_id[card]])
        return TYPE_MISMATCH;
    if (d->uuid_ok && !d->uuid_ok[card])
        return UUID_MISMATCH;
    return FITS;
}

static int8_t usage_code(const gs_cluster_t *c, int64_t card, const usage_t *u,
                         const gs_container_t *ct, int64_t mem)
{
    /* as differences from the capacity: a demand near INT64_MAX cannot wrap into a fit */
    if (u->slots >= c->cap_slots[card])
        return SLOTS_EXHAUSTED;
    if (mem > c->cap_mem[card] - u->mem)
        return INSUFFICIENT_MEMORY;
    if (ct->cores > c->cap_cores[card] - u->cores)
        return INSUFFICIENT_CORE;
    if (u->owned || (ct->exclusive && u->slots > 0))
        return EXCLUSIVE_CONFLICT;
    if (ct->cores == 0 && u->cores >= c->cap_cores[card])
        return COMPUTE_EXHAUSTED;
    return FITS;
}

/* HAMi's card score: 10 x (shares of slots, cores and memory in use after this
 * container, weighted); 0 for a card without slots, cores or memory. Sums in
 * double: it is taken of cards the demand does not fit too, however large. */
static double hami_card_score(const gs_cluster_t *c, int64_t card, const usage_t *u,
                              const gs_container_t *ct, int64_t mem, const double *weight)
{
    int64_t slots = c->cap_slots[card], cores = c->cap_cores[card], memory = c->cap_mem[card];
    if (slots <= 0 || cores <= 0 || memory <= 0)
        return 0.0;
    return 10.0 * (weight[0] * (((double)u->slots + 1.0) / (double)slots) +
                   weight[1] * (((double)u->cores + (double)ct->cores) / (double)cores) +
                   weight[2] * (((double)u->mem + (double)mem) / (double)memory));
}

/* HAMi's node score before the pod: 10 x (share of slots + cores + memory in use). */
static double hami_node_score(const gs_cluster_t *c, int64_t first, int64_t k)
{
    int64_t used[3] = {0, 0, 0}, cap[3] = {0, 0, 0};
    for (int64_t card = first; card < first + k; card++) {
        used[0] += c->used_slots[card];
        used[1] += c->used_cores[card];
        used[2] += c->used_mem[card];
        cap[0] += c->cap_slots[card];
        cap[1] += c->cap_cores[card];
        cap[2] += c->cap_mem[card];
    }
    double score = 0.0;
    for (int i = 0; i < 3; i++)
        score += (double)used[i] / (double)at_least_one(cap[i]);
    return 10.0 * score;
}

/* ---------------------------------------------------------------- picking */

static int by_rank(const void *pa, const void *pb)
{
    const ranked_t *a = pa, *b = pb;
    if (a->group != b->group)
        return a->group < b->group ? -1 : 1;
    /* higher first, NaN last: a total order even where a score is NaN (a mix of
     * non-finite weights), which qsort needs */
    int a_nan = isnan(a->score), b_nan = isnan(b->score);
    if (a_nan != b_nan)
        return a_nan ? 1 : -1;
    if (!a_nan && a->score != b->score)
        return a->score > b->score ? -1 : 1;
    if (a->tie != b->tie)
        return a->tie > b->tie ? -1 : 1;
    return a->row < b->row ? -1 : (a->row > b->row);
}

/* HAMi's card list order: score, then NUMA node, low first; then the order the
 * list had (its sort keeps equal cards in place on nodes of up to 12 cards). */
static int by_list(const void *pa, const void *pb)
{
    const ranked_t *a = pa, *b = pb;
    int a_nan = isnan(a->score), b_nan = isnan(b->score);
    if (a_nan != b_nan)
        return a_nan ? -1 : 1;
    if (!a_nan && a->score != b->score)
        return a->score < b->score ? -1 : 1;
    if (a->group != b->group)
        return a->group < b->group ? -1 : 1;
    return a->tie < b->tie ? -1 : (a->tie > b->tie);
}

/* Whether row a goes before row b in HAMi's list by score and NUMA node alone. */
static int list_before(const int64_t *numa, const double *score, int64_t a, int64_t b)
{
    int a_nan = isnan(score[a]), b_nan = isnan(score[b]);
    if (a_nan != b_nan)
        return a_nan;
    if (!a_nan && score[a] != score[b])
        return score[a] < score[b];
    return numa[a] < numa[b];
}

#define SMALL_LIST 16

/* Re-sort the node's card list by this container's scores, as HAMi does before
 * each container: `order` becomes the list (place -> row) and `pos` each row's
 * place in it. HAMi takes cards from the end of the list. A small list is sorted
 * by insertion (stable: equal cards keep their order), a larger one by qsort
 * with the old place as the last key. */
static void list_order(const gs_cluster_t *c, int64_t first, int64_t k, const double *score,
                       int64_t *pos, int64_t *order, ranked_t *ranked)
{
    const int64_t *numa = c->numa + first;
    if (k <= SMALL_LIST) {
        for (int64_t j = 0; j < k; j++)
            order[pos[j]] = j;
        for (int64_t p = 1; p < k; p++) {
            int64_t row = order[p], q = p;
            for (; q > 0 && list_before(numa, score, row, order[q - 1]); q--)
                order[q] = order[q - 1];
            order[q] = row;
        }
    } else {
        for (int64_t j = 0; j < k; j++) {
            /* the NUMA node as an unsigned key that keeps signed order */
            ranked[j].group = (uint64_t)numa[j] ^ ((uint64_t)1 << 63);
            ranked[j].score = score[j];
            ranked[j].tie = pos[j];
            ranked[j].row = j;
        }
        qsort(ranked, (size_t)k, sizeof *ranked, by_list);
        for (int64_t p = 0; p < k; p++)
            order[p] = ranked[p].row;
    }
    for (int64_t p = 0; p < k; p++)
        pos[order[p]] = p;
}

/* HAMi's pick without NUMA binding: the first `count` fitting cards from the end
 * of the list; 0, and `picked` left as it was (no card), when there are fewer. */
static int pick_from_list(const int8_t *codes, const int64_t *order, int64_t k, int64_t count,
                          int64_t *picked)
{
    int64_t n = 0;
    for (int64_t p = k - 1; p >= 0 && n < count; p--)
        n += codes[order[p]] == FITS;
    if (n < count)
        return 0;
    n = 0;
    for (int64_t p = k - 1; p >= 0 && n < count; p--)
        if (codes[order[p]] == FITS)
            picked[n++] = order[p];
    return 1;
}

/* The best `count` fitting rows of the node into `picked`; 0 when it has too few
 * (in one NUMA group when `bind`): the group whose top cards sum to the best score,
 * the first such group on a tie. Among equal scores the higher `tie` first, else
 * (NULL) the lower row. */
static int pick(const gs_cluster_t *c, int64_t first, int64_t k, const int8_t *codes,
                const double *score, const int64_t *tie, int64_t count, int bind,
                ranked_t *ranked, int64_t *picked)
{
    int64_t fitting = 0;
    for (int64_t j = 0; j < k; j++) {
        if (codes[j] != FITS)
            continue;
        int64_t numa = c->numa[first + j];
        ranked[fitting].group = bind && numa >= 0 ? (uint64_t)numa + 1 : 0;
        ranked[fitting].score = score[j];
        ranked[fitting].tie = tie ? tie[j] : -j;
        ranked[fitting].row = j;
        fitting++;
    }
    if (fitting < count)
        return 0;
    qsort(ranked, (size_t)fitting, sizeof *ranked, by_rank);
    int64_t best = -1;
    double best_score = -INFINITY;
    for (int64_t start = 0, end; start < fitting; start = end) {
        for (end = start; end < fitting && ranked[end].group == ranked[start].group; end++)
            ;
        if (end - start < count)
            continue;
        double sum = 0.0;
        for (int64_t r = start; r < start + count; r++)
            sum += ranked[r].score;
        if (best < 0 ? sum > -INFINITY : sum > best_score) {
            best = start;
            best_score = sum;
        }
    }
    if (best < 0)
        return 0;
    for (int64_t r = 0; r < count; r++)
        picked[r] = ranked[best + r].row;
    return 1;
}

/* Why the node failed for this container: its code, and the card codes counted.
 * As HAMi: first a node with fewer cards than the container asks for at all. */
static int8_t explain(const int8_t *codes, int64_t k, int64_t count, int32_t *counts)
{
    memset(counts, 0, GS_CODE_COUNT * sizeof *counts);
    for (int64_t j = 0; j < k; j++)
        counts[codes[j]]++;
    if (k - counts[NOT_FOUND] < count)
        return NODE_INSUFFICIENT_DEVICE;
    if (counts[FITS] >= count)
        return NUMA_NOT_FIT;
    if (counts[FITS] > 0)
        return TOO_FEW_CARDS;
    int8_t dominant = 1;
    for (int8_t code = 2; code < GS_CODE_COUNT; code++)
        if (counts[code] > counts[dominant])
            dominant = code;
    return dominant;
}

/* ---------------------------------------------------------------- scratch */

static int fragments_alloc(fragments_t *f, int64_t cards, int64_t parts)
{
    size_t c = (size_t)(cards > 0 ? cards : 1), p = (size_t)(parts > 0 ? parts : 1);
    f->count = calloc(p, sizeof *f->count);
    f->unusable = calloc(p, sizeof *f->unusable);
    f->usable = calloc(c * p, 1);
    f->share = calloc(c, sizeof *f->share);
    return f->count && f->unusable && f->usable && f->share;
}

static void fragments_free(fragments_t *f)
{
    free(f->count);
    free(f->unusable);
    free(f->usable);
    free(f->share);
}

static void scratch_free(scratch_t *s)
{
    free(s->base);
    free(s->now);
    free(s->statics);
    free(s->codes);
    free(s->mem);
    free(s->pos);
    free(s->order);
    free(s->card_score);
    free(s->card_frag);
    free(s->card_total);
    free(s->ranked);
    fragments_free(&s->before);
    fragments_free(&s->after);
    fragments_free(&s->one);
    free(s->host_before.hosted);
    free(s->host_before.stranded);
    free(s->host_after.hosted);
    free(s->host_after.stranded);
}

static int scratch_alloc(scratch_t *s, int64_t cards, int64_t parts)
{
    memset(s, 0, sizeof *s);
    if (cards < 0 || parts < 0 || (parts > 0 && cards > INT64_MAX / 64 / parts))
        return 0;
    size_t c = (size_t)(cards > 0 ? cards : 1);
    s->base = calloc(c, sizeof *s->base);
    s->now = calloc(c, sizeof *s->now);
    s->statics = calloc(c, 1);
    s->codes = calloc(c, 1);
    s->mem = calloc(c, sizeof *s->mem);
    s->pos = calloc(c, sizeof *s->pos);
    s->order = calloc(c, sizeof *s->order);
    s->card_score = calloc(c, sizeof(double));
    s->card_frag = calloc(c, sizeof(double));
    s->card_total = calloc(c, sizeof(double));
    s->ranked = calloc(c, sizeof *s->ranked);
    int ok = s->base && s->now && s->statics && s->codes && s->mem && s->pos && s->order &&
             s->card_score &&
             s->card_frag && s->card_total && s->ranked;
    ok = fragments_alloc(&s->before, cards, parts) && ok;
    ok = fragments_alloc(&s->after, cards, parts) && ok;
    ok = fragments_alloc(&s->one, 1, parts) && ok;
    size_t cells = (size_t)(parts > 0 ? parts : 1) * (size_t)(cards + 1);
    hosting_t *hosts[] = {&s->host_before, &s->host_after};
    for (int i = 0; i < 2; i++) {
        hosts[i]->hosted = calloc(cells, sizeof(double));
        hosts[i]->stranded = calloc(cells, sizeof(double));
        ok = ok && hosts[i]->hosted && hosts[i]->stranded;
    }
    return ok;
}

static int64_t largest_node(const gs_cluster_t *c, const int64_t *nodes, int64_t n)
{
    int64_t largest = 0;
    for (int64_t i = 0; i < n; i++) {
        if (nodes[i] < 0 || nodes[i] >= c->node_count)
            return -1;
        int64_t k = c->node_start[nodes[i] + 1] - c->node_start[nodes[i]];
        if (k < 0)
            return -1;
        if (k > largest)
            largest = k;
    }
    return largest;
}

static void load_usage(const gs_cluster_t *c, int64_t first, int64_t k, usage_t *u)
{
    for (int64_t j = 0; j < k; j++) {
        u[j].mem = c->used_mem[first + j];
        u[j].cores = c->used_cores[first + j];
        u[j].slots = c->used_slots[first + j];
        u[j].owned = c->owned[first + j];
    }
}

/* ---------------------------------------------------------------- evaluation */

int gs_engine_abi(void)
{
    return GS_ENGINE_ABI;
}

int gs_fragmentation(const gs_cluster_t *cluster, const gs_mix_t *mix, const int64_t *nodes,
                     int64_t n, double *fragmentation, double *total)
{
    int64_t largest = largest_node(cluster, nodes, n);
    if (largest < 0 || !mix)
        return GS_EINVAL;
    scratch_t s;
    if (!scratch_alloc(&s, largest, mix->parts)) {
        scratch_free(&s);
        return GS_ENOMEM;
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t first = cluster->node_start[nodes[i]];
        int64_t k = cluster->node_start[nodes[i] + 1] - first;
        load_usage(cluster, first, k, s.base);
        hosting_build(mix, cluster->cpu_free[nodes[i]], cluster->mem_free[nodes[i]], k,
                      &s.host_before);
        node_fragments(cluster, mix, first, k, s.base, &s.host_before, &s.before);
        fragmentation[i] = s.before.frag;
        total[i] = s.before.total;
    }
    scratch_free(&s);
    return GS_OK;
}

typedef struct {
    const gs_cluster_t *c;
    const gs_demand_t *d;
    const gs_mix_t *m;
    int use_fragments; /* the mix prices cards or nodes */
    int single;        /* one card for one container: the node's price is that card's */
    int64_t *offset;   /* per container: where its picks start in result->chosen */
} plan_t;

/* Row i of the result: node `node`, whose picks are still all -1. */
static void evaluate_node(const plan_t *plan, scratch_t *s, int64_t i, int64_t node,
                          gs_result_t *r)
{
    const gs_cluster_t *c = plan->c;
    const gs_demand_t *d = plan->d;
    const gs_mix_t *m = plan->m;
    int64_t first = c->node_start[node], k = c->node_start[node + 1] - first;
    double cpu_free = c->cpu_free[node], mem_free = c->mem_free[node];
    double cpu_after = cpu_free - d->cpu, mem_after = mem_free - d->memory;

    r->code[i] = FITS;
    r->failed[i] = GS_FAIL_NONE;
    r->feasible[i] = 0;
    r->score[i] = -INFINITY;
    if (!(cpu_free >= d->cpu && mem_free >= d->memory)) {
        r->code[i] = TOO_FEW_CARDS;
        r->failed[i] = GS_FAIL_NODE_SHORT;
        return;
    }
    load_usage(c, first, k, s->base);
    memcpy(s->now, s->base, (size_t)k * sizeof *s->now);
    if (plan->use_fragments) {
        hosting_build(m, cpu_free, mem_free, k, &s->host_before);
        hosting_build(m, cpu_after, mem_after, k, &s->host_after);
        node_fragments(c, m, first, k, s->base, &s->host_before, &s->before);
    }

    for (int64_t j = 0; j < k && d->containers > 0; j++)
        s->statics[j] = static_code(c, d, first + j);
    const double weight[3] = {d->slot_weight, d->core_weight, d->mem_weight};
    const double even[3] = {1.0, 1.0, 1.0};
    int hami_policy = d->gpu_policy != GS_POLICY_FRAGMENTATION;
    for (int64_t ci = 0; ci < d->containers; ci++) {
        const gs_container_t *ct = &d->container[ci];
        /* HAMi sorts a fresh copy of the node's list for each init container and for
         * the first app container; later app containers find the list as left. */
        if (hami_policy && (ci == 0 || ct->init || d->container[ci - 1].init))
            for (int64_t j = 0; j < k; j++)
                s->pos[j] = j;
        for (int64_t j = 0; j < k; j++) {
            int64_t cap_mem = c->cap_mem[first + j];
            s->mem[j] = ct->mem_mib >= 0 ? ct->mem_mib : percent_of(cap_mem, ct->mem_percent);
            s->codes[j] = s->statics[j] ? s->statics[j]
                                        : usage_code(c, first + j, &s->now[j], ct, s->mem[j]);
            if (hami_policy) { /* every card: the list's order depends on all of them */
                double hami = hami_card_score(c, first + j, &s->now[j], ct, s->mem[j], weight);
                s->card_score[j] = d->gpu_policy == GS_POLICY_BINPACK ? hami : -hami;
                continue;
            }
            if (s->codes[j] != FITS)
                continue;
            double hami = hami_card_score(c, first + j, &s->now[j], ct, s->mem[j], even);
            /* Less added fragmentation first; among equals, the fuller card. */
            usage_t after = s->now[j];
            after.mem += s->mem[j];
            after.cores += ct->cores;
            after.slots += 1;
            after.owned = after.owned || ct->exclusive;
            double total;
            double frag = fragmentation_after(c, m, first, j, &after, &s->before, &s->one,
                                              &s->host_after, &total);
            s->card_score[j] = -(frag - s->before.frag) + 1e-6 * hami;
            s->card_frag[j] = frag;
            s->card_total[j] = total;
        }
        if (hami_policy)
            list_order(c, first, k, s->card_score, s->pos, s->order, s->ranked);
        int64_t *picked = r->chosen + plan->offset[ci] + i * ct->count;
        int bind = d->numa_bind && ct->count > 1;
        int found = hami_policy && !bind
                        ? pick_from_list(s->codes, s->order, k, ct->count, picked)
                        : pick(c, first, k, s->codes, s->card_score, hami_policy ? s->pos : NULL,
                               ct->count, bind, s->ranked, picked);
        if (!found) {
            for (int64_t p = 0; p < ci; p++) { /* the node keeps no earlier cards */
                int64_t count = d->container[p].count;
                for (int64_t q = 0; q < count; q++)
                    r->chosen[plan->offset[p] + i * count + q] = -1;
            }
            r->code[i] = explain(s->codes, k, ct->count, r->counts + i * GS_CODE_COUNT);
            r->failed[i] = (int32_t)(GS_FAIL_CONTAINER + ci);
            return;
        }
        for (int64_t q = 0; q < ct->count; q++) {
            int64_t j = picked[q];
            picked[q] = first + j; /* rows of the node -> the cluster's card indexes */
            if (!ct->init || ct->sidecar) { /* a plain init container shares no card */
                s->now[j].mem += s->mem[j];
                s->now[j].cores += ct->cores;
                s->now[j].slots += 1;
                s->now[j].owned = s->now[j].owned || ct->exclusive;
            }
        }
    }

    r->feasible[i] = 1;
    if (d->node_policy != GS_POLICY_NONE || !plan->use_fragments) {
        double hami = hami_node_score(c, first, k);
        r->score[i] = d->node_policy == GS_POLICY_SPREAD ? -hami : hami;
    } else if (plan->single) {
        int64_t j = r->chosen[i] - first;
        r->score[i] = -(s->card_frag[j] - s->before.frag) - 1e-9 * s->card_total[j];
    } else {
        /* Less added fragmentation first; among equals, the node left with less free. */
        node_fragments(c, m, first, k, s->now, &s->host_after, &s->after);
        r->score[i] = -(s->after.frag - s->before.frag) - 1e-9 * s->after.total;
    }
}

int gs_evaluate(const gs_cluster_t *cluster, const gs_demand_t *demand, const gs_mix_t *mix,
                const int64_t *nodes, int64_t n, gs_result_t *result)
{
    const gs_demand_t *d = demand;
    int64_t largest = largest_node(cluster, nodes, n);
    if (largest < 0 || n < 0 || d->gpu_policy < GS_POLICY_FRAGMENTATION ||
        d->gpu_policy > GS_POLICY_SPREAD || d->node_policy < GS_POLICY_FRAGMENTATION ||
        d->node_policy > GS_POLICY_NONE)
        return GS_EINVAL;
    if (d->containers > 0 && d->gpu_policy == GS_POLICY_FRAGMENTATION && !mix)
        return GS_EINVAL;
    int64_t containers = d->containers > 0 ? d->containers : 0;
    int64_t *offset = calloc((size_t)containers + 1, sizeof *offset);
    if (!offset)
        return GS_ENOMEM;
    for (int64_t ci = 0; ci < containers; ci++) {
        if (d->container[ci].count < 1) {
            free(offset);
            return GS_EINVAL;
        }
        offset[ci + 1] = offset[ci] + n * d->container[ci].count;
    }
    for (int64_t q = 0; q < offset[containers]; q++)
        result->chosen[q] = -1;
    for (int64_t i = 0; i < n; i++)
        memset(result->counts + i * GS_CODE_COUNT, 0, GS_CODE_COUNT * sizeof *result->counts);

    plan_t plan = {
        .c = cluster,
        .d = d,
        .m = mix,
        .use_fragments = mix != NULL && (d->gpu_policy == GS_POLICY_FRAGMENTATION ||
                                         d->node_policy == GS_POLICY_NONE),
        .single = containers == 1 && d->container[0].count == 1 && !d->container[0].init &&
                  d->gpu_policy == GS_POLICY_FRAGMENTATION,
        .offset = offset,
    };
    scratch_t s;
    if (!scratch_alloc(&s, largest, mix ? mix->parts : 0)) {
        scratch_free(&s);
        free(offset);
        return GS_ENOMEM;
    }
    for (int64_t i = 0; i < n; i++)
        evaluate_node(&plan, &s, i, nodes[i], result);
    scratch_free(&s);
    free(offset);
    return GS_OK;
}
