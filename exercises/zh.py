"""The exercises in Chinese: each exercise's TITLE, question, ASKS labels, HINT and the
explanation shown with a right answer, and the messages of ``python -m exercises --lang zh``.

Imported only when Chinese is asked for (``--lang zh``, or LANG / LC_ALL starting with zh),
and never imports the engine. The terms are the chapter's (step14_5.md): 链式 hash, 冷请求,
预计算, block, prefix cache, lookup, Sequence, hit / miss. The values to predict, their
order and the stored answers (answers.json) are the English exercises'; a question built
from a constant (``__doc__.format(lookups=LOOKUPS)``) is formatted with the same constant.
``tests/test_exercises_zh.py`` checks that every text is here and agrees with the English.
"""
from __future__ import annotations

import re
import unicodedata
from types import SimpleNamespace

TEXTS: dict[int, dict] = {
    1: {
        "TITLE": "章节的代码片段，照字面运行",
        "ASKS": ("hash 调用次数，16 token 分块", "cache 条目数，16 token 分块",
                 "新请求从 cache 拿到的 token 数，16 token 分块", "hash 调用次数，512 token 分块"),
        "HINT": "在 lookup 的 hash 调用之上，再数这段代码的 hash 调用。然后问：第一个 block 是以哪个 "
                "hash 保存的？lookup 刚结束时 seq._prev_hash 是什么？",
        "DOC": """练习 1：章节里的 ``_do_prefill_step`` 代码片段，照字面读。

章节在每个 prefill 分块结束时这样保存一个 block：

    if end % self.block_size == 0 and end <= prompt_len:
        h = self._chain_hash(seq.prompt_ids.tolist(), seq._prev_hash, end - self.block_size, end)
        seq._block_hashes.append(h)
        seq._prev_hash = h
        self._save_prefix_cache(seq, h, end)

``SnippetPrefixCache``（在 exercises/ex1_snippet_pitfall.py 里）就是本引擎的 ``PrefixCache``，
只把 ``_do_prefill_step`` 逐行换成了这段代码。有三行要翻译成本引擎的写法：

* ``seq.prompt_ids.tolist()`` 写成 ``seq.token_view()``：同样的 id，不复制；
* ``seq._prev_hash = h`` 没有单独的一行：这里 ``_prev_hash`` 是一个 property，返回
  ``_block_hashes[-1]``，所以紧挨在前面的 ``append`` 已经让它等于 ``h``；
* ``self._save_prefix_cache(seq, h, end)`` 写成 ``_snippet_save(seq, h, end)``：把结束于
  ``end`` 的 block 登记在 ``h`` 之下（引擎自己的方法接收一个 block，而不是 end）。

记住在它之前运行的是什么：请求被接纳时，``_lookup_prefix_cache`` 会调用
``_precompute_block_hashes``，为整个 prompt 预计算好 ``_block_hashes``。

设定：一个 4096 token 的 prompt，block_size 16（N = 256 个完整 block），prefix cache 为空。
它以 16 token 的分块 prefill；然后在一个新的空 cache 上全部重来一遍，改用 512 token 的分块。
用这段代码，预测：

1. 冷请求在 16 token 分块下的 hash 调用次数（它的 lookup + 它的保存）；
2. 之后 prefix cache 里的条目数（16 token 分块）；
3. 之后一个 prompt 相同的新请求，能从 cache 拿到 4096 个 token 中的多少个
   （16 token 分块）；
4. 冷请求在 512 token 分块下的 hash 调用次数。
""",
        "WHY": "lookup 已经算过全部 256 个 block 的 hash（_precompute_block_hashes），所以这段代码在保存时"
               "把每个 block 又算了一次：16 token 分块下共 2N = 512 次调用，_block_hashes 也长到 2N 个。"
               "更糟的是它从错误的父 hash 接链：lookup 之后 _prev_hash 是 block 255 的 hash，所以 block 0 "
               "以 hash(block 0, seed = block 255 的 hash) 保存。这个名字在字典里（256 个条目），但没有哪次 "
               "lookup 会查它，所以新请求从 cache 拿到 4096 个 token 中的 0 个。用 512 token 分块时，这段代码"
               "只在每个分块的结尾看到 block 边界：N + 8 = 264 次调用，只登记了 8 个 block。本引擎在 "
               "prefix_cache.py 里有两处修正：_hash_for_save 复用 seq._block_hashes[index]（lookup 存下的 "
               "hash），而不是再算一次、再 append 一次；_do_prefill_step 登记分块内部的每个 block 边界，而不"
               "只是分块的结尾。运行它：两种分块大小下都是 256 次调用、256 个条目、新请求从 cache 拿到 4080 "
               "个 token。",
    },
    2: {
        "TITLE": "换一个 block size 的表格",
        "ASKS": ("(a) recompute", "(a) incremental", "(b) recompute", "(b) incremental"),
        "HINT": "(b) 中新请求的每个 block 都已缓存，但装着最后一个 token 的 block 从不从 cache 取：采样"
                "需要它的 logits。这个 block 被重新计算并保存时，会发生什么？",
        "DOC": """练习 2：预测章节的表格在另一个 block size 下的格子。

``python run.py`` 打印 527 token 演示 prompt 在 block_size 16 下的章节表格，并在下面给出每一行
背后的规则：

    recompute 在每次 lookup 时对每个完整 block 算 hash，save 时再对每个新算出的完整 block
    算一次；incremental 对每个 Sequence 的每个完整 block 只算一次。

用这条规则预测它没有打印的两个格子。

(a) 同一个 prompt，block_size 8（N = 527 // 8 = 65 个完整 block）。"冷请求"这一行：cache
    从没见过的 prompt，单独发送；它的 lookup + 它的 prefill 算出的那些 block 的保存。
(b) prompt 的前 512 个 token，block_size 16（block 的整数倍：N = 32）。先发冷请求；它结束后，
    把同一个 prompt 作为新请求再发一次。"相同 prompt、新的 Sequence"这一行：新请求的
    lookup + 它的保存。

预测：

1. (a) recompute 的 hash 调用次数；
2. (a) incremental 的 hash 调用次数；
3. (b) recompute 的 hash 调用次数；
4. (b) incremental 的 hash 调用次数。
""",
        "WHY": "(a) 就是 N = 65 时的规则：recompute 在 lookup 时算 65 个 block 的 hash，保存它们时再算同样"
               "的 65 个（130）；incremental 只在 lookup 时算一次，保存时复用（65）。(b) 与规则的 N / N 差"
               "一次调用：512 是 block 的整数倍，而最后一个 token 的 logits 必须算出来，所以完全缓存的 prompt "
               "仍要计算它的最后一个 block（hit 在差一个 block 处停下）。recompute 保存这个 block 时再算一次"
               "它的 hash（lookup 时 32 次 + 1 = 33）：保存时找到相同的已缓存 block，调度器让请求改用它（一个 "
               "twin）。incremental 复用已有的 hash（32）。在 527 个 token 时最后一个 block 不完整，从不算 "
               "hash，所以这一行是 N / N。",
    },
    3: {
        "TITLE": "被抢占的请求回来了",
        "ASKS": ("被抢占时的完整 block 数", "recompute：hash 调用次数", "incremental：hash 调用次数"),
        "HINT": "recompute 下的一次 lookup 会在这个 sequence 的所有完整 block 上重建链式 hash，prompt 的和 "
                "decode 出来的都算。incremental 下，sequence 等待期间它的链在哪里？",
        "DOC": """练习 3：一个被抢占（preempt）的请求回来了。它重新被接纳要花多少次 hash？

两个请求，各带一个 200 个随机 token 的 prompt（block_size 16：12 个完整 block 再加 8 个
token），在只有 30 个 block 的 pool 里各 decode 64 个 token。接纳时两个都放得下（各 13 个
block）。decode 过程中它们的 block 逐渐填满：decode 时填满的 block 同样会算 hash 并缓存，所以
每个 sequence 的链都在增长。pool 满了以后，下一个需要新 block 的 token 会让调度器抢占最近被
接纳的 sequence。它的 block 被释放（已缓存的仍可复用），它作为同一个 ``Sequence`` 对象（连同
它的链）回到队列最前面。

从那时起，每一步接纳时都会对它 lookup 一次，直到又有空间给它；它再次运行之前被 lookup 了
{lookups} 次。

预测：

1. 被抢占时，这个 sequence 的 token 填满了多少个完整 block（也就是对它的一次 lookup 要覆盖
   多长的链）；
2. 在 ``hash_strategy="recompute"`` 下，这 {lookups} 次 lookup 的 hash 调用次数；
3. 在 ``"incremental"`` 下，这 {lookups} 次 lookup 的 hash 调用次数。

本练习通过 prefix cache 的事件日志（``llm.prefix_cache.recording()``）计数：lookup 时算的
hash，以及每探查一次 block 0 记一次 lookup。
""",
        "WHY": "两个 sequence 各持有 15 个 block 时 pool 就满了：30 个 block / 2 = 每个 15 个 block = 240 个 "
               "token，所以被抢占的 sequence 有 12 个 prompt block 和 3 个 decode block，共 15 个完整 block。"
               "在另一个请求生成完它的 64 个 token、释放它的 block 之前，它回不来，所以它被 lookup 了 24 次。"
               "recompute 每次 lookup 都重建整条 15 个 block 的链：24 x 15 = 360 次调用。incremental 读的是"
               "同一个 Sequence 对象在抢占期间保留下来的链：0 次调用。章节说的\"相同 prompt 再次请求 0 次"
               " hash\"就在这里起作用：同一个 Sequence 的重试和重新接纳。两种策略下调度完全相同，只有 hash "
               "次数不同。",
    },
    4: {
        "TITLE": "只有 3 个值的 hash",
        "ASKS": ("最多条目数", "是否有 token 不同（yes/no）", "hit 的 block 数与条目数相比（fewer/equal/more）"),
        "HINT": "只有父 block 已缓存时，一个 block 才会被保存。那么 prompt 的哪些 block 可能在字典里？"
                "第二个请求会走过其中的哪些？",
        "DOC": """练习 4：换上一个只有 3 个值的 hash。碰撞会不会产生错误的 token？

``llm.prefix_cache.hash_fn`` 可以替换：任何 (block 的字节, seed) -> int 的函数都行。把 xxhash
换成 ``(seed + data[0]) % 3``：每个 block 的 hash 于是只能是 0、1 或 2，不同的 block 总在碰撞。
把演示 prompt（527 个 token，32 个完整 block）发送一次；再把它作为新请求发送一次。

每个已缓存的 block 记着它存的 token id、它的父 block 和它的 ``cache_salt``。lookup 在某个
block 的 hash 下找到条目时，先检查这些（``PrefixCache._holds``）才算 hit；保存时如果发现这个
hash 下已经有另一个 block，就不把自己的 block 放进字典。

预测：

1. 用这个 hash，prefix cache 最多能有多少个条目；
2. 第二个请求的输出 token 是否有任何一个与同一引擎用 xxhash 时的输出不同
   （yes / no，也可以写 是 / 否）；
3. 第二个请求 hit 的 block 数，与第一个请求之后 cache 里的条目数相比
   （fewer / equal / more，也可以写 更少 / 相等 / 更多）。
""",
        "WHY": "3 个值的 hash 最多给出 3 个条目；这里只有 2 个：第三个 block 的 hash 已经被一个装着别的 "
               "token 的 block 占了，所以第三个 block 保持私有，它之后的都不能保存（一个 block 只有在父 "
               "block 已缓存后才保存）。这些条目正好是 prompt 开头的 block，所以第二个请求全部 hit（equal）。"
               "到下一个 block 时，它在自己的 hash 下找到一个装着别的 token 的条目；PrefixCache._holds"
               "（token、父 block、salt）拒绝它，lookup 就停在那里。碰撞只会带来一次 miss，从不带来错误的 "
               "token：输出与 xxhash 的完全相同。",
    },
    5: {
        "TITLE": "改掉一个 token",
        "ASKS": ("16：从 cache 拿到的 token 数", "16：新的 hash 数", "32：从 cache 拿到的 token 数",
                 "32：新的 hash 数", "64：从 cache 拿到的 token 数", "64：新的 hash 数"),
        "HINT": "从 cache 拿到的 token 以整个 block 为单位，而且只有改动之前的 block 能 hit。prompt 有 "
                "527 // block_size 个完整 block。",
        "DOC": """练习 5：改掉一个 token。哪些 block 还能 hit？

发送演示 prompt（527 个 token）；然后发送同一个 prompt，只把位置 300 上的 token 换成另一个。
一个 block 的 hash 以它父 block 的 hash 为种子（链式 hash），所以一个 hash 就代表到它为止的
整个前缀。位置 300 落在 block 300 // block_size 里。

预测第二个请求的：

1. block_size 16：从 cache 拿到的 token 数；
2. block_size 16：hash 与第一个请求不同的完整 block 数；
3. block_size 32：从 cache 拿到的 token 数；
4. block_size 32：hash 变了的完整 block 数；
5. block_size 64：从 cache 拿到的 token 数；
6. block_size 64：hash 变了的完整 block 数。

之后用 ``python run.py --chain --change-at 300`` 逐个 block 地看。
""",
        "WHY": "改动在 block 300 // block_size 里：size 16 时是 block 18，32 时是 block 9，64 时是 block 4。"
               "它之前的每个 block 保持原来的 hash 并 hit：18 x 16 = 288、9 x 32 = 288、4 x 64 = 256 个 "
               "token。这个 block 因为它的 token 变了而改变，之后的每个完整 block 因为父 block 的 hash 变了"
               "而改变：32 - 18 = 14、16 - 9 = 7、8 - 4 = 4 个新 hash。链式 hash 让一个 block 的 hash 代表"
               "它的整个前缀，所以 lookup 不必比较前面的 block 就能信任一次 hit。",
    },
    6: {
        "TITLE": "lookup 为什么停在那里？",
        "ASKS": ("(a) 原因", "(c) 原因", "(d) 原因", "(e) 原因", "(f) block", "(f) 原因"),
        "HINT": "只有装满的 block 才会缓存，装着最后一个 token 的 block 从不从 cache 取。请求需要 block "
                "而没有空闲的时，已缓存但空闲的 block 按最久未用的先复用；一个结束的请求从它的最后一个 "
                "block 到第一个依次释放。",
        "DOC": """练习 6：lookup 为什么停在那里？

每次 lookup 都会在某处停下，引擎会说出原因：在 trace 的 "miss" 事件上，也在请求的输出里、
``num_cached_tokens`` 旁边的 ``cache_miss_reason``（它的 ``.reason``）。各种原因，以及回答时
用的代号（用英文代号回答）：

    never-saved  这个 block 的 hash 没有条目，也从没有条目离开过字典
    evicted      这个 block 的 hash 没有条目：它的 pool block 被复用时，条目离开了字典
    collision    这个 hash 下的条目存着别的 token
    salt         这个 block 的 token 缓存在另一个 cache_salt 之下
    partial      已命中的 block 之后剩下的是一个不完整的 block（从不缓存）
    last-token   下一个 block 装着最后一个 token，它从不从 cache 取
    in-flight    另一个正在运行的请求正在计算下一个 block（请求等一步）

演示 prompt P 有 {prompt_len} 个 token；block_size 16；pool 有 {pool} 个 block；每个请求只要
1 个新 token，并且在下一个请求发出之前结束。按顺序：

(a) P 的前 10 个 token；
(b) P；
(c) 再发一次 P，作为新请求；
(d) P 的前 512 个 token；
(e) 带 ``cache_salt="alice"`` 的 P；
(f) 另一段文字的 {other} 个 token（它需要的 block 比空闲的多），然后再发一次 P。

预测：

1. (a) 的 lookup 为什么停下（一个代号）；
2. (c) 的 lookup 为什么停下；
3. (d) 的 lookup 为什么停下；
4. (e) 的 lookup 为什么停下；
5. (f) 里 P 最后一次 lookup 停在哪个 block（它的编号）；
6. 它为什么停在那里。

之后用 ``python run.py --chain``，或者在 step page 上，看一次运行里的每个原因。
""",
        "WHY": "(a) 10 个 token 不到一个 block，而只有完整的 block 才会缓存：没有东西可查，从 cache 拿到 0 个 "
               "token：partial（比一个 block 短的前缀永远不会 hit）。(c) P 的 32 个完整 block 全部 hit（512 个 "
               "token）；lookup 停在 block 32，即 token 512-526，一个不完整的 block：partial。(d) 512 个 token "
               "正好是 32 个 block；block 31 装着最后一个 token（位置 511），采样需要它的 logits，所以它被计算，"
               "而不是从 cache 取：last-token（从 cache 拿到 496 个 token）。(e) cache_salt 是链的种子，所以 "
               "block 0 的 hash 不同；同样的 token 已经缓存了，但没有 salt：salt。(f) 另一段文字需要 48 个 "
               "block；先用不带 hash 的 36 个（100 - 2 x 32 个已缓存），然后按最久未用的先淘汰 12 个已缓存但空闲"
               "的 block。P 的 block 最后一次由 (d) 释放，从最后一个到第一个，所以 block 31 到 20 被淘汰：P "
               "hit block 0-19（320 个 token），停在 block 20：evicted，原因里还写着是第几次淘汰、为哪个请求。",
    },
}

MESSAGES = {
    "right": "对了。{why}",
    "count": "练习 {number} 需要 {n} 个值，按这个顺序：{asks}。收到 {got} 个。",
    "wrong": ("还不对。这些值是一起检查的，所以这里不会说哪一个不对。再想想，或者运行实验："
              "python -m exercises {number} --run（它会显示答案）。"),
    "hint": "提示：{hint}",
    "usage": ("\npython -m exercises N --lang zh               题目设定和要预测的内容\n"
              "python -m exercises N --lang zh --answer ...  检查你的预测\n"
              "python -m exercises N --lang zh --hint        提示\n"
              "python -m exercises N --run                   运行实验（会显示答案；报告为英文）"),
    "check": ("\n检查你的预测（每个编号的条目一个值，按顺序）：\n"
              "  python -m exercises {number} --lang zh --answer {values}\n"
              "提示：python -m exercises {number} --lang zh --hint"),
    "run": "运行实验（报告为英文）：",
}

def text_of(number: int, found: dict) -> SimpleNamespace:
    """Exercise ``number`` in Chinese. ``found``: the English source's constants
    (``exercises.constants_of``); the question is formatted as the English one is."""
    texts = TEXTS[number]
    doc = texts["DOC"]
    fields = found.get("__format__")
    if fields:
        doc = doc.format(**{arg: found[constant] for arg, constant in fields.items()})
    return SimpleNamespace(__doc__=doc, TITLE=texts["TITLE"], ASKS=texts["ASKS"], HINT=texts["HINT"])


_TOKEN = re.compile(r"[!-~]+|\s+|.")  # a run of printable ASCII (a word, a value, an identifier), or one character
_NO_LINE_START = set("，。；：、！？）》」』”’,.;:!?)")


def width(text: str) -> int:
    """Columns ``text`` takes in a terminal: a CJK character (or full-width sign) takes two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def fill(text: str, columns: int = 96) -> str:
    """textwrap.fill for mixed Chinese and English: a line may break between any two Chinese
    characters, never inside an ASCII word or identifier, and not before closing punctuation."""
    lines, line = [], ""
    for token in _TOKEN.findall(text):
        if token.isspace():
            token = " "
            if not line:
                continue
        if line and width(line) + width(token) > columns and token[0] not in _NO_LINE_START:
            lines.append(line.rstrip())
            line = "" if token == " " else token
            continue
        line += token
    if line.strip():
        lines.append(line.rstrip())
    return "\n".join(lines)
