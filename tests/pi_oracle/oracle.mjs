// pi itself as the test oracle (see tests/support_pi.py).
//   node oracle.mjs context FILE [INDEX...]
//     opens a COPY of FILE with pi's SessionManager (pi rewrites files it migrates) and prints
//     {header, entries, leaf: buildSessionContext(), branch: getBranch()'s ids,
//      at: {INDEX: context at entries[INDEX]}}
//     (indexes, not ids: pi draws the ids of a migrated version-1 file at random)
//   node oracle.mjs contexts FILE...
//     [{header, entries, leaf, branch}] of each FILE as "context" prints them (one node for
//     many files: pi's import is most of a call's time)
//   node oracle.mjs opened FILE...
//     [{header, entries, name}] of each FILE as pi's SessionManager opens it (name: its
//     getSessionName(); one node for many files)
//   node oracle.mjs append FILE MESSAGE_JSON
//     opens FILE itself and appends one message through pi's API; prints {id}
import { copyFileSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { SessionManager, buildSessionContext } from "@mariozechner/pi-coding-agent";

function context(dir, path, name, indexes) {
	const copy = join(dir, name);
	copyFileSync(path, copy);
	const manager = SessionManager.open(copy, dir);
	const entries = manager.getEntries();
	const at = {};
	for (const index of indexes) at[index] = buildSessionContext(entries, entries[Number(index)].id);
	const leaf = manager.buildSessionContext();
	const branch = manager.getBranch().map((e) => e.id ?? null);
	return { header: manager.getHeader(), entries, leaf, branch, at };
}

const [command, file, ...rest] = process.argv.slice(2);
if (command === "context" || command === "contexts") {
	const dir = mkdtempSync(join(tmpdir(), "pi-oracle-"));
	try {
		const out =
			command === "context"
				? context(dir, file, "session.jsonl", rest)
				: [file, ...rest].map((path, i) => context(dir, path, `${i}.jsonl`, []));
		process.stdout.write(JSON.stringify(out));
	} finally {
		rmSync(dir, { recursive: true, force: true });
	}
} else if (command === "opened") {
	const dir = mkdtempSync(join(tmpdir(), "pi-oracle-"));
	try {
		const out = [file, ...rest].map((path, i) => {
			const copy = join(dir, `${i}.jsonl`);
			copyFileSync(path, copy);
			const manager = SessionManager.open(copy, dir);
			const name = manager.getSessionName() ?? null;
			return { header: manager.getHeader(), entries: manager.getEntries(), name };
		});
		process.stdout.write(JSON.stringify(out));
	} finally {
		rmSync(dir, { recursive: true, force: true });
	}
} else if (command === "append") {
	const manager = SessionManager.open(file);
	const id = manager.appendMessage(JSON.parse(rest[0]));
	process.stdout.write(JSON.stringify({ id }));
} else {
	process.stderr.write(`unknown command ${command}\n`);
	process.exit(2);
}
