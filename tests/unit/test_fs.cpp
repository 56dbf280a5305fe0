// File-system helpers: temporary files of killed processes are found and removed (and nothing
// else is), an AtomicFile replaces its target whole or not at all, and an output directory that
// cannot be created is an error naming the key, the path, the reason and the fix.

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"
#include "support/temp_dir.h"

using namespace glmtune;
namespace fs = std::filesystem;
using glmtune::test::read_text;
using glmtune::test::TempDir;
using glmtune::test::write_text;

namespace {

// A pid that no process has: a child that has exited and been reaped.
pid_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  ::waitpid(pid, nullptr, 0);
  return pid;
}

std::string tmp_name(const std::string& base, const std::string& host, pid_t pid) {
  return base + ".tmp." + (host.empty() ? "" : host + ".") + std::to_string(pid);
}

}  // namespace

TEST(TemporaryFiles, NamesCarryTheHostAndThePid) {
  const fs::path p = temporary_path("dir/data.cache");
  EXPECT_EQ(p.string(),
            "dir/data.cache.tmp." + temporary_host_tag() + "." + std::to_string(::getpid()));
  for (char c : temporary_host_tag()) EXPECT_TRUE(std::isalnum(c) || c == '-') << c;
}

TEST(TemporaryFiles, OnlyThoseOfDeadProcessesOfThisHostAreRemoved) {
  TempDir dir("fs");
  const std::string host = temporary_host_tag();
  const pid_t dead = dead_pid();
  const std::string stale = tmp_name("a.cache", host, dead);
  const std::string stale_legacy = tmp_name("b.cache.mask", "", dead);
  const std::string live = tmp_name("c.cache", host, ::getppid());
  const std::string own = tmp_name("d.cache", host, ::getpid());
  const std::string remote = tmp_name("e.cache", "some-other-host", dead);
  const std::string unrelated = "notes.tmp.txt";
  for (const auto& n : {stale, stale_legacy, live, own, remote, unrelated})
    write_text(dir / n, std::string(100, 'x'));
  fs::create_directories(dir / tmp_name("visible-dir", host, dead));  // not a writer's directory

  EXPECT_EQ(remove_stale_temporary_files(dir.path()), 2u);
  EXPECT_FALSE(fs::exists(dir / stale));
  EXPECT_FALSE(fs::exists(dir / stale_legacy));
  for (const auto& n : {live, own, remote, unrelated}) EXPECT_TRUE(fs::exists(dir / n)) << n;
  EXPECT_TRUE(fs::exists(dir / tmp_name("visible-dir", host, dead)));

  // Limited to some names, the others stay.
  const std::string x = tmp_name("x.json", host, dead), y = tmp_name("y.json", host, dead);
  write_text(dir / x, "x");
  write_text(dir / y, "y");
  EXPECT_EQ(remove_stale_temporary_files(dir.path(), {"x.json"}), 1u);
  EXPECT_FALSE(fs::exists(dir / x));
  EXPECT_TRUE(fs::exists(dir / y));
}

TEST(TemporaryFiles, AtomicWriteLeavesNoTemporaryFileOnError) {
  TempDir dir("fs");
  write_file_atomic((dir / "f.json").string(), "{}\n");
  EXPECT_EQ(read_text(dir / "f.json"), "{}\n");
  // Renaming over a non-empty directory fails after the temporary file was written.
  fs::create_directories(dir / "taken" / "inside");
  EXPECT_THROW(write_file_atomic((dir / "taken").string(), "x"), Error);
  size_t entries = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    ++entries;
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
  }
  EXPECT_EQ(entries, 2u);
}

namespace {

// The names in `dir`, sorted.
std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST(AtomicFile, TheTargetStaysOldUntilCommitThenIsTheNewFileWhole) {
  TempDir dir("fs");
  const fs::path target = dir / "data.bin";
  write_text(target, "old content");
  {
    AtomicFile file(target);
    EXPECT_EQ(file.target(), target);
    EXPECT_EQ(file.path(), temporary_path(target));
    // A streamed write: a placeholder header, the body, then the header patched in place.
    file.write("....");
    file.write(std::string("body"));
    file.pwrite("HEAD", 4, 0);
    file.truncate(10);
    EXPECT_EQ(read_text(target), "old content");
    EXPECT_EQ(entries(dir.path()),
              (std::vector<std::string>{"data.bin", temporary_path(target).filename().string()}));
    file.commit();
    EXPECT_TRUE(file.committed());
  }
  EXPECT_EQ(read_text(target), std::string("HEADbody\0\0", 10));
  EXPECT_EQ(entries(dir.path()), (std::vector<std::string>{"data.bin"}));
}

TEST(AtomicFile, WithoutCommitTheTemporaryFileGoesAndTheTargetStays) {
  TempDir dir("fs");
  write_text(dir / "kept", "old");
  {
    AtomicFile file(dir / "kept");
    file.write("half of the new");
  }
  {
    AtomicFile file(dir / "never");
    file.write("x");
  }
  EXPECT_EQ(read_text(dir / "kept"), "old");
  EXPECT_EQ(entries(dir.path()), (std::vector<std::string>{"kept"}));
}

TEST(AtomicFile, AFailedRenameNamesTheTargetAndLeavesNoTemporaryFile) {
  TempDir dir("fs");
  fs::create_directories(dir / "taken" / "inside");  // rename cannot replace a non-empty directory
  try {
    AtomicFile file(dir / "taken");
    file.write("new");
    file.commit();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.where(), (dir / "taken").string());
    EXPECT_NE(e.problem().find("cannot rename"), std::string::npos) << e.what();
    EXPECT_NE(e.fix().find("directory"), std::string::npos) << e.what();
  }
  EXPECT_EQ(entries(dir.path()), (std::vector<std::string>{"taken"}));
  EXPECT_TRUE(fs::is_directory(dir / "taken" / "inside"));
}

TEST(AtomicFile, AMissingDirectoryIsAnErrorNamingThePathAndTheFix) {
  TempDir dir("fs");
  const fs::path target = dir / "missing" / "out.json";
  try {
    AtomicFile file(target);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.where().rfind(target.string(), 0), 0u) << e.what();  // the temporary name
    EXPECT_NE(e.fix().find("parent directory"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(entries(dir.path()).empty());
}

TEST(AtomicFile, AFailedWriteNamesTheFileAndLeavesTheOldTarget) {
  TempDir dir("fs");
  const fs::path target = dir / "big.bin";
  write_text(target, "old");
  // A file-size limit makes the write fail part-way (EFBIG) as a full disk would; SIGXFSZ is
  // ignored so that it is an error, not a kill.
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  rlimit small = saved;
  small.rlim_cur = 4096;
  auto* old_handler = std::signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  bool threw = false;
  try {
    AtomicFile file(target);
    file.write(std::string(10000, 'x'));
    file.commit();
  } catch (const Error& e) {
    threw = true;
    EXPECT_EQ(e.where(), temporary_path(target).string());
    EXPECT_NE(e.problem().find("write failed"), std::string::npos) << e.what();
    EXPECT_NE(e.fix().find("ulimit -f"), std::string::npos) << e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_TRUE(threw);
  EXPECT_EQ(read_text(target), "old");
  EXPECT_EQ(entries(dir.path()), (std::vector<std::string>{"big.bin"}));
}

TEST(AtomicFile, WriteFileAtomicReplacesAnExistingFile) {
  TempDir dir("fs");
  write_file_atomic((dir / "f.txt").string(), "first, longer content");
  write_file_atomic((dir / "f.txt").string(), "second");
  EXPECT_EQ(read_text(dir / "f.txt"), "second");
  EXPECT_EQ(entries(dir.path()), (std::vector<std::string>{"f.txt"}));
}

TEST(TemporaryFiles, RemoveOnExitRemovesUnlessReleased) {
  TempDir dir("fs");
  write_text(dir / "a", "a");
  write_text(dir / "b", "b");
  {
    RemoveOnExit a(dir / "a"), b(dir / "b");
    b.release();
  }
  EXPECT_FALSE(fs::exists(dir / "a"));
  EXPECT_TRUE(fs::exists(dir / "b"));
}

TEST(OutputDirectory, APathThroughAFileNamesTheKeyThePathAndTheFix) {
  TempDir dir("fs");
  write_text(dir / "file", "not a directory");
  const fs::path wanted = dir / "file" / "run" / "out";
  try {
    create_output_directory(wanted, "recipe.toml: output.dir");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.where(), "recipe.toml: output.dir");
    EXPECT_NE(e.problem().find(wanted.string()), std::string::npos) << e.what();
    EXPECT_NE(e.problem().find((dir / "file").string() + " is a file"), std::string::npos)
        << e.what();
    EXPECT_NE(e.fix().find("output.dir"), std::string::npos) << e.what();
  }
  // The path itself a file.
  try {
    create_output_directory(dir / "file", "--out");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.where(), "--out");
    EXPECT_NE(e.problem().find("is a file"), std::string::npos) << e.what();
  }
  // The parent of a file to be written.
  EXPECT_THROW(create_parent_directory(dir / "file" / "x.cache", "--out"), Error);
  create_parent_directory(dir / "new" / "deeper" / "x.cache", "--out");
  EXPECT_TRUE(fs::is_directory(dir / "new" / "deeper"));
  create_output_directory(dir / "new", "--out");  // existing: fine
}

TEST(OutputDirectory, AReadOnlyParentGivesTheOsReasonAndTheDirectoryToFix) {
  if (::geteuid() == 0) GTEST_SKIP() << "permissions do not bind root";
  TempDir dir("fs");
  fs::create_directories(dir / "ro");
  fs::permissions(dir / "ro", fs::perms::owner_read | fs::perms::owner_exec);
  try {
    create_output_directory(dir / "ro" / "out", "--out");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(e.problem().find("Permission denied"), std::string::npos) << e.what();
    EXPECT_NE(e.fix().find((dir / "ro").string() + " is not writable"), std::string::npos)
        << e.what();
  }
  fs::permissions(dir / "ro", fs::perms::owner_all);
}
