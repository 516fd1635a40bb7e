#!/usr/bin/env bash
# The whole pytest suite in three streams at once, so `make test` fits CI's time.
#
# Most of the suite's wall time is waiting (emulated 100 ms paths, two-minute
# style periods, timeouts), not CPU: in two streams (namespaces | the rest)
# the machine's two cores were idle a third of the time (vmstat, 30 min), and
# each stream took 27-30 min. Three streams of about equal length, by folder:
#
#   A  the trials (tests/wan), Docker (tests/deploy), the router, the testbed's
#      own tests, the Atlas namespace tests;
#   B  the study (tests/study, and the demo that runs it), operations; in a
#      mount namespace of its own with a private /run/netns;
#   C  everything else.
#
# Tests that build namespaces still run one after another within a stream (they
# measure time and bandwidth), but now two such tests may run at once, one in
# A and one in B. What must not see the other stream's work does not: `ip
# netns list` and the namespaces' names live in /run/netns, which stream B has
# to itself (the testbed's and the demo's "nothing left behind" checks compare
# the whole list before and after); the veths the Docker tests put in the root
# namespace, which the topology test compares too, come only from stream A.
# Measured (one run, lint and Rust beside): A 19:37, B 22:01, C 19:25, where
# the two streams took 27-30 min each; with db moved from B to C, on a clean
# clone: A 20:05, B 20:07, C 19:14.
# Each stream has its own temporary directory and embedded PostgreSQL. Tests
# marked `quiet` (rates from Python sender threads, sub-millisecond delays: a
# neighbour's CPU burst shows in them) run last, alone.
#
# Each stream ends with its 25 slowest tests and when it ended: CI's budget is
# 40 minutes.
#
# BESIDE_TESTS, if set, is a command run beside the streams, niced (make test:
# the linters and the Rust tests, about 2 minutes of both cores alone). Its output
# is printed when the streams end; its failure fails the run, after all the
# tests.
#
# Usage: [BESIDE_TESTS=COMMAND] tools/run-tests.sh PYTEST [pytest options...]
# (options such as -x or -k apply to every stream; the streams choose the paths)
set -uo pipefail
pytest=$1
shift
work=$(mktemp -d /tmp/kickass-tests.XXXXXX)
started=$SECONDS
elapsed() { printf '%dm%02ds' $(((SECONDS - started) / 60)) $(((SECONDS - started) % 60)); }
trap 'rm -rf "$work"' EXIT

stream_a=(tests/wan tests/deploy tests/router tests/testbed/test_topology.py
    tests/testbed/test_testbed_cli.py tests/testbed/test_experiment_cli.py
    tests/atlas/test_atlas_evping_netns.py
    tests/atlas/test_atlas_evping_late_netns.py tests/atlas/test_icmp_responder_netns.py)
stream_b=(tests/study tests/testbed/test_demo.py tests/operations)
ignore_ab=()
for p in "${stream_a[@]}" "${stream_b[@]}"; do
    ignore_ab+=("--ignore=$p")
done

# A background job of a script starts with SIGINT and SIGQUIT ignored, and its
# children would inherit that: the tests that stop a program with Ctrl-C need
# the default.
run_bg() {
    env --default-signal=INT,QUIT "$@"
}

run_bg "$pytest" -q --durations=25 -m "not quiet" --basetemp "$work/a" \
    "${stream_a[@]}" "$@" >"$work/a.log" 2>&1 &
a_pid=$!
mkdir -p /run/netns
run_bg unshare --mount --propagation private -- sh -c \
    'mount -t tmpfs -o mode=0755 kickass-tests-netns /run/netns && exec "$@"' sh \
    "$pytest" -q --durations=25 -m "not quiet" --basetemp "$work/b" \
    "${stream_b[@]}" "$@" >"$work/b.log" 2>&1 &
b_pid=$!
echo "stream A (trials, Docker, router, testbed): running in the background"
echo "stream B (study, demo, operations; its own /run/netns): running in the background"
beside_pid=
if [ -n "${BESIDE_TESTS:-}" ]; then
    echo "beside them: $BESIDE_TESTS"
    # Niced: it has the streams' whole length to finish in, and the tests
    # that measure time are the ones a compiler beside them hurts.
    nice -n 10 bash -c "$BESIDE_TESTS" >"$work/beside.log" 2>&1 &
    beside_pid=$!
fi
echo "stream C (everything else):"
"$pytest" -q --durations=25 -m "not quiet" --basetemp "$work/c" tests "${ignore_ab[@]}" "$@"
c_rc=$?
echo "stream C: done at $(elapsed)"
wait "$a_pid"
a_rc=$?
wait "$b_pid"
b_rc=$?
echo "streams A and B: done by $(elapsed) (each one's own time ends its log, below)"
beside_rc=0
if [ -n "$beside_pid" ]; then
    wait "$beside_pid"
    beside_rc=$?
    echo
    echo "$BESIDE_TESTS:"
    cat "$work/beside.log"
fi
echo
echo "stream A (trials, Docker, router, testbed):"
cat "$work/a.log"
echo
echo "stream B (study, demo, operations):"
cat "$work/b.log"
echo
echo "tests that run alone: from $(elapsed)"
"$pytest" -q --durations=25 -m quiet --basetemp "$work/quiet" "$@"
quiet_rc=$?
echo
echo "all done at $(elapsed)"
echo "pytest exit status: stream A $a_rc, B $b_rc, C $c_rc, alone $quiet_rc"
if [ "$beside_rc" -ne 0 ]; then
    echo "FAILED: $BESIDE_TESTS (exit status $beside_rc)"
    exit 1
fi
# 5: no tests collected in a stream (a -k or path selection): not a failure.
all5=1
for rc in "$a_rc" "$b_rc" "$c_rc" "$quiet_rc"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
        exit 1
    fi
    [ "$rc" -eq 5 ] || all5=0
done
[ "$all5" -eq 0 ] || exit 5
