#!/usr/bin/env bash
# The whole pytest suite in two streams at once, so `make test` fits CI's time.
#
# Most of the suite's wall time is waiting (emulated 100 ms paths, two-minute
# style periods, timeouts), not CPU: run alone it kept about one of the two
# cores busy. The tests that build network namespaces or change the machine's
# own network (marked `netns` or `machine`) run one after another in one
# stream, as before: they measure time and bandwidth, and some compare the
# machine's namespaces and links before and after. Everything else (its own
# PostgreSQL, loopback servers, simulated time) runs in the other stream.
# Each stream has its own temporary directory and embedded PostgreSQL. Tests
# marked `quiet` (rates from Python sender threads, sub-millisecond delays: a
# neighbour's CPU burst shows in them) run last, when both streams are done.
#
# Each stream ends with its 25 slowest tests and its wall time: CI's budget
# is 40 minutes.
#
# BESIDE_TESTS, if set, is a command run beside both streams (make test: the
# linters and the Rust tests, about 2 minutes of both cores alone; before the
# streams they were that much longer on CI's clock, and before the main stream
# alone 4 minutes under the namespace one's load). Its output is printed when
# the streams end; its failure fails the run, after all the tests.
#
# Usage: [BESIDE_TESTS=COMMAND] tools/run-tests.sh PYTEST [pytest arguments...]
set -uo pipefail
pytest=$1
shift
work=$(mktemp -d /tmp/kickass-tests.XXXXXX)
started=$SECONDS
elapsed() { printf '%dm%02ds' $(((SECONDS - started) / 60)) $(((SECONDS - started) % 60)); }
trap 'rm -rf "$work"' EXIT
serial="netns or machine"

# A background job of a script starts with SIGINT and SIGQUIT ignored, and its
# children would inherit that: the tests that stop a program with Ctrl-C need
# the default.
env --default-signal=INT,QUIT \
    "$pytest" -q --durations=25 -m "($serial) and not quiet" --basetemp "$work/serial" "$@" >"$work/serial.log" 2>&1 &
serial_pid=$!
echo "tests that build namespaces or touch the machine's network: running in the background"
beside_pid=
if [ -n "${BESIDE_TESTS:-}" ]; then
    echo "beside them: $BESIDE_TESTS"
    bash -c "$BESIDE_TESTS" >"$work/beside.log" 2>&1 &
    beside_pid=$!
fi
echo "everything else:"
"$pytest" -q --durations=25 -m "not ($serial) and not quiet" --basetemp "$work/rest" "$@"
rest_rc=$?
echo "everything else: done at $(elapsed)"
if kill -0 "$serial_pid" 2>/dev/null; then
    echo "waiting for the namespace tests..."
fi
wait "$serial_pid"
serial_rc=$?
beside_rc=0
if [ -n "$beside_pid" ]; then
    wait "$beside_pid"
    beside_rc=$?
    echo
    echo "$BESIDE_TESTS:"
    cat "$work/beside.log"
fi
echo
echo "tests that build namespaces or touch the machine's network: done at $(elapsed)"
cat "$work/serial.log"
echo
echo "tests that run alone: from $(elapsed)"
"$pytest" -q --durations=25 -m quiet --basetemp "$work/quiet" "$@"
quiet_rc=$?
echo
echo "all done at $(elapsed)"
echo "pytest exit status: namespace stream $serial_rc, the rest $rest_rc, alone $quiet_rc"
if [ "$beside_rc" -ne 0 ]; then
    echo "FAILED: $BESIDE_TESTS (exit status $beside_rc)"
    exit 1
fi
# 5: no tests collected in a stream (a -k or path selection): not a failure.
all5=1
for rc in "$serial_rc" "$rest_rc" "$quiet_rc"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
        exit 1
    fi
    [ "$rc" -eq 5 ] || all5=0
done
[ "$all5" -eq 0 ] || exit 5
